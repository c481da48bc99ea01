/** Idempotency keys and retries: every write keyed, resent with its key on the answers that decide nothing, and applied once. */

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, test } from 'node:test';

import * as fencegate from 'fencegate';

import { BACKENDS, CUT, defer, gatewayOn, Hop, ScriptedGateway, type ScriptedAnswer } from './harness.js';

const FAST = { attempts: 6, backoffMs: 10, maxBackoffMs: 50 };

const unavailable = (applied: boolean | null): ScriptedAnswer => [503, { error: 'backend_unavailable', write_applied: applied }];
const CREATED: ScriptedAnswer = [201, { resource: 'orders', key: 'o-1', token: 1, version: 1 }];

/** The `Idempotency-Key` lines clients sent through a hop, in order. */
function sentKeys(hop: Hop): string[] {
  return hop
    .sent()
    .toString('latin1')
    .toLowerCase()
    .split('\r\n')
    .filter((line) => line.startsWith('idempotency-key:'))
    .map((line) => line.slice('idempotency-key:'.length).trim());
}

for (const backend of BACKENDS) {
  describe(`on the ${backend} backend`, () => {
    test('the same key twice is applied once, and replayed', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      const key = randomUUID();

      const first = await gateway.put('orders', 'o-1', 'paid', { token: 1, idempotencyKey: key });
      assert.deepEqual([first.created, first.version, first.replayed], [true, 1, false]);
      const again = await gateway.put('orders', 'o-1', 'paid', { token: 1, idempotencyKey: key });
      assert.deepEqual([again.created, again.version, again.replayed], [true, 1, true], 'the stored 201, not a second write');
      assert.equal((await gateway.get('orders', 'o-1'))?.version, 1);

      assert.equal((await gateway.advance('orders', { token: 2, idempotencyKey: `${key}-advance` })).replayed, false);
      const advanced = await gateway.advance('orders', { token: 2, idempotencyKey: `${key}-advance` });
      assert.deepEqual([advanced.replayed, advanced.highest], [true, 2n]);
      const deleted = await gateway.delete('orders', 'o-1', { token: 2, idempotencyKey: `${key}-delete` });
      assert.deepEqual(await gateway.delete('orders', 'o-1', { token: 2, idempotencyKey: `${key}-delete` }), {
        ...deleted,
        replayed: true,
      });
    });

    test('a key is kept across clients as across restarts', async (t) => {
      // A writer that persisted its key resends the write from a new process: the gateway
      // answers with the first attempt's outcome, even after a newer term wrote.
      const process = await gatewayOn(t, backend);
      const first = new fencegate.Gateway(process.url);
      defer(t, () => first.close());
      assert.equal((await first.put('orders', 'o-1', 'paid', { token: 1, idempotencyKey: 'order-o-1-paid' })).version, 1);
      await first.put('orders', 'o-1', 'by the next term', { token: 2 });
      const restarted = new fencegate.Gateway(process.url);
      defer(t, () => restarted.close());
      const again = await restarted.put('orders', 'o-1', 'paid', { token: 1, idempotencyKey: 'order-o-1-paid' });
      assert.deepEqual([again.version, again.token, again.replayed], [1, 1n, true]);
      const stored = await restarted.get('orders', 'o-1');
      assert.deepEqual([stored?.text(), stored?.version], ['by the next term', 2]);
    });

    test('a key reused for another write is refused', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      await gateway.put('orders', 'o-1', 'paid', { token: 1, idempotencyKey: 'k-1' });
      await assert.rejects(gateway.put('orders', 'o-1', 'refunded', { token: 1, idempotencyKey: 'k-1' }), (error) => {
        assert.ok(error instanceof fencegate.IdempotencyKeyReused);
        assert.ok(!(error instanceof fencegate.TransientError));
        assert.equal(error.status, 422);
        return true;
      });
      const stored = await gateway.get('orders', 'o-1');
      assert.deepEqual([stored?.text(), stored?.version], ['paid', 1]);
      await assert.rejects(gateway.put('orders', 'o-1', 'v', { token: 1, idempotencyKey: 'not\nascii' }), /Idempotency-Key/);
    });

    test('every write gets a key of its own', async (t) => {
      const process = await gatewayOn(t, backend);
      const hop = await Hop.open(t, process.addr);
      const gateway = new fencegate.Gateway(hop.url, { holder: 'node-a' });
      defer(t, () => gateway.close());
      await gateway.put('orders', 'o-1', 'v', { token: 1 });
      await gateway.put('orders', 'o-1', 'v', { token: 1 }); // the same write again: a new logical write
      await gateway.delete('orders', 'o-1', { token: 1 });
      await gateway.advance('orders', { token: 2 });
      await gateway.txn([{ op: 'put', resource: 'orders', key: 'o-2', value: 'v', token: 2 }]);
      const state = await gateway.acquireLease('sweeper', { ttlMs: 10_000 });
      assert.ok(state.token !== null);
      await gateway.renewLease('sweeper', { token: state.token, ttlMs: 10_000 });
      await gateway.releaseLease('sweeper', { token: state.token });
      await gateway.get('orders', 'o-2');
      await gateway.fence('orders');
      const keys = sentKeys(hop);
      assert.equal(keys.length, 8, 'one key per write, none on reads');
      assert.equal(new Set(keys).size, 8, 'a key was used for two writes');
      for (const key of keys) assert.match(key, /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
    });

    test('an answer lost after the commit is resent with its key and replayed', async (t) => {
      const process = await gatewayOn(t, backend);
      const hop = await Hop.open(t, process.addr);
      const gateway = new fencegate.Gateway(hop.url, { retry: FAST });
      defer(t, () => gateway.close());

      hop.loseAnswers(1);
      const result = await gateway.put('orders', 'o-1', 'paid', { token: 1 });
      assert.equal(hop.lost, 1);
      assert.deepEqual([result.version, result.created, result.replayed], [1, true, true]);
      const keys = sentKeys(hop);
      assert.ok(keys.length === 2 && keys[0] === keys[1], "the retry did not carry the first attempt's key");

      hop.loseAnswers(2);
      const outcome = await gateway.txn([{ op: 'put', resource: 'orders', key: 'o-1', value: 'shipped', token: 1, ifMatch: 1 }]);
      assert.equal(hop.lost, 3);
      assert.ok(outcome.replayed);
      assert.deepEqual(outcome.results, [
        { op: 'put', resource: 'orders', token: 1n, key: 'o-1', version: 2, created: false },
      ], 'applied once, whatever the retries');
      const stored = await gateway.get('orders', 'o-1');
      assert.deepEqual([stored?.text(), stored?.version], ['shipped', 2]);

      const lease = gateway.lease('billing', { holder: 'node-a', ttlMs: 10_000 });
      assert.ok(await lease.acquire({ wait: false }));
      defer(t, () => lease.release());
      hop.loseAnswers(1);
      const written = await lease.put('b-1', 'under the lease');
      assert.deepEqual([hop.lost, written.version, written.replayed], [4, 1, true]);
    });

    test('a lease resends only while its term lasts', async (t) => {
      const process = await gatewayOn(t, backend);
      const hop = await Hop.open(t, process.addr);
      const gateway = new fencegate.Gateway(hop.url, {
        holder: 'node-a',
        timeoutMs: 1_000,
        retry: { attempts: 1_000, backoffMs: 50, maxBackoffMs: 50 },
      });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs: 1_500 });
      assert.ok(await lease.acquire({ wait: false }));
      hop.loseAnswers(1_000_000); // renewals and writes: nothing comes back any more
      const began = performance.now();
      await assert.rejects(lease.put('k', 'v'), (error) => {
        assert.ok(error instanceof fencegate.LeaseLost);
        assert.ok(error.cause instanceof fencegate.GatewayUnreachable);
        assert.equal(error.cause.writeApplied, null);
        return true;
      });
      assert.ok(performance.now() - began < 1_500, 'resent past the term\'s deadline');
      assert.equal(lease.reason, 'deadline');
      hop.loseAnswers(0);
      await lease.release();
    });
  });
}

// ---------------------------------------------------------------- what is resent

test('the answers that decide nothing are resent with the same key', async (t) => {
  const server = await ScriptedGateway.start(
    t,
    CUT,
    unavailable(null),
    unavailable(false),
    [503, { error: 'overloaded' }, { 'retry-after': '0' }],
    [503, { error: 'shutting_down' }, { 'retry-after': '0' }],
    [409, { error: 'idempotency_in_flight' }, { 'retry-after': '0' }],
    CREATED,
  );
  const gateway = new fencegate.Gateway(server.url, { retry: { attempts: 7, backoffMs: 10 } });
  defer(t, () => gateway.close());
  const result = await gateway.put('orders', 'o-1', 'v', { token: 1 });
  assert.deepEqual([result.version, result.created], [1, true]);
  server.assertDone();
  const keys = server.keys();
  assert.equal(keys.length, 7);
  assert.equal(new Set(keys).size, 1);
  assert.ok(keys[0] !== undefined);
});

test('a stale token is never resent', async (t) => {
  const server = await ScriptedGateway.start(t, unavailable(null), [
    409,
    {
      error: 'stale_token',
      resource: 'orders',
      presented: 1,
      highest: 2,
      stale: [{ resource: 'orders', presented: 1, highest: 2 }],
    },
  ]);
  const gateway = new fencegate.Gateway(server.url, { retry: FAST });
  defer(t, () => gateway.close());
  await assert.rejects(gateway.put('orders', 'o-1', 'v', { token: 1 }), (error) => {
    assert.ok(error instanceof fencegate.StaleToken);
    assert.deepEqual(error.stale, [{ resource: 'orders', presented: 1n, highest: 2n }]);
    return true;
  });
  server.assertDone();
  assert.equal(server.requests.length, 2);
});

for (const [answer, raised] of [
  [[422, { error: 'idempotency_key_reused' }], fencegate.IdempotencyKeyReused],
  [[412, { error: 'version_mismatch', current: 3 }], fencegate.VersionMismatch],
  [[408, { error: 'body_timeout' }], fencegate.BodyTimeout],
  [[400, { error: 'invalid_idempotency_key' }], fencegate.InvalidIdempotencyKey],
  [[500, { error: 'internal' }], fencegate.Internal],
] as const) {
  test(`a decided answer is the write's own: ${answer[1].error}`, async (t) => {
    const server = await ScriptedGateway.start(t, answer);
    const gateway = new fencegate.Gateway(server.url, { retry: FAST });
    defer(t, () => gateway.close());
    await assert.rejects(gateway.put('orders', 'o-1', 'v', { token: 1 }), raised);
    server.assertDone();
  });
}

test('attempts are bounded, and the last error keeps the doubt', async (t) => {
  const server = await ScriptedGateway.start(t, unavailable(null), unavailable(false), unavailable(false));
  const gateway = new fencegate.Gateway(server.url, { retry: { attempts: 3, backoffMs: 10 } });
  defer(t, () => gateway.close());
  await assert.rejects(gateway.put('orders', 'o-1', 'v', { token: 1 }), (error) => {
    assert.ok(error instanceof fencegate.BackendUnavailable);
    assert.equal(error.attempts, 3);
    assert.equal(error.writeApplied, null, 'the first attempt may have been applied');
    return true;
  });
  server.assertDone();
  assert.equal(new Set(server.keys()).size, 1);
});

test('NO_RETRY sends once, and reads are never resent', async (t) => {
  const server = await ScriptedGateway.start(t, unavailable(false), unavailable(false));
  const once = new fencegate.Gateway(server.url, { retry: fencegate.NO_RETRY });
  defer(t, () => once.close());
  await assert.rejects(once.put('orders', 'o-1', 'v', { token: 1, idempotencyKey: 'mine' }), (error) => {
    assert.ok(error instanceof fencegate.BackendUnavailable);
    assert.deepEqual([error.attempts, error.writeApplied], [1, false]);
    return true;
  });
  const patient = new fencegate.Gateway(server.url, { retry: FAST });
  defer(t, () => patient.close());
  await assert.rejects(patient.fence('orders'), fencegate.BackendUnavailable);
  server.assertDone();
  assert.deepEqual(server.keys(), ['mine', undefined]);
});

test('an aborted signal stops the resends', async (t) => {
  const server = await ScriptedGateway.start(t, unavailable(null));
  const gateway = new fencegate.Gateway(server.url, { retry: { attempts: 5, backoffMs: 10_000, maxBackoffMs: 10_000 } });
  defer(t, () => gateway.close());
  const controller = new AbortController();
  const write = gateway.put('orders', 'o-1', 'v', { token: 1, signal: controller.signal });
  setTimeout(() => controller.abort(new Error('the writer gave up')), 200);
  await assert.rejects(write, /the writer gave up/);
  server.assertDone();
  assert.equal(server.requests.length, 1);
});

test('retry policies are checked', () => {
  assert.throws(() => new fencegate.Gateway('http://127.0.0.1:9', { retry: { attempts: 0 } }), /attempts/);
  assert.throws(() => fencegate.retryPolicy({ backoffMs: 3_000, maxBackoffMs: 1_000 }), /backoffMs/);
  assert.deepEqual(fencegate.retryPolicy(), fencegate.DEFAULT_RETRY);
  assert.throws(() => fencegate.checkIdempotencyKey('x'.repeat(256)), RangeError);
  assert.equal(fencegate.checkIdempotencyKey('order-1/paid'), 'order-1/paid');
});
