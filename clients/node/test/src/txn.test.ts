/** Transactions over several resources (`POST /v1/txn`), on both backends: all or nothing, with every stale resource named. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import * as fencegate from 'fencegate';

import { BACKENDS, defer, gatewayOn } from './harness.js';

async function read(gateway: fencegate.Gateway, resource: string, key: string): Promise<[string, number] | null> {
  const stored = await gateway.get(resource, key);
  return stored === null ? null : [Buffer.from(stored.value).toString('latin1'), stored.version];
}

for (const backend of BACKENDS) {
  describe(`on the ${backend} backend`, () => {
    test('a transaction applies every operation', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      await gateway.put('shard-7', 'owner', 'node-a', { token: 12 });
      await gateway.put('shard-7', 'handoff', 'pending', { token: 12 });
      await gateway.put('cluster-config', 'layout', 'v1', { token: 5 });

      const outcome = await gateway.txn([
        { op: 'put', resource: 'shard-7', key: 'owner', value: 'node-b', token: 12, ifMatch: 1 },
        { op: 'delete', resource: 'shard-7', key: 'handoff', token: 12n, ifMatch: '*' },
        { op: 'advance', resource: 'queue-7', token: 30 },
        { op: 'check', resource: 'cluster-config', token: 5, key: 'layout', version: 1 },
        { op: 'put', resource: 'shard-7', key: 'bytes', value: Uint8Array.from([0, 255, 32]), token: 12, ifMatch: 0 },
        { op: 'check', resource: 'cluster-config', token: 5 },
      ]);
      assert.equal(outcome.replayed, false);
      assert.deepEqual(outcome.results, [
        { op: 'put', resource: 'shard-7', token: 12n, key: 'owner', version: 2, created: false },
        { op: 'delete', resource: 'shard-7', token: 12n, key: 'handoff', version: 2 },
        { op: 'advance', resource: 'queue-7', token: 30n },
        { op: 'check', resource: 'cluster-config', token: 5n, key: 'layout', version: 1 },
        { op: 'put', resource: 'shard-7', token: 12n, key: 'bytes', version: 1, created: true },
        { op: 'check', resource: 'cluster-config', token: 5n },
      ]);
      assert.deepEqual(await read(gateway, 'shard-7', 'owner'), ['node-b', 2]);
      assert.equal(await read(gateway, 'shard-7', 'handoff'), null);
      assert.deepEqual(await read(gateway, 'shard-7', 'bytes'), ['\u0000\u00ff ', 1]);
      assert.equal((await gateway.fence('queue-7')).highest, 30n);
      assert.equal((await gateway.fence('cluster-config')).highest, 5n, 'a check raises nothing');
      await assert.rejects(gateway.advance('queue-7', { token: 29 }), fencegate.StaleToken);
    });

    test('a stale transaction names every stale resource and applies nothing', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      await gateway.put('alpha', 'k', 'before', { token: 3 });
      await gateway.advance('beta', { token: 8 });
      await gateway.advance('gamma', { token: 9 });

      await assert.rejects(
        gateway.txn([
          { op: 'put', resource: 'alpha', key: 'k', value: 'after', token: 3 },
          { op: 'advance', resource: 'delta', token: 4 },
          { op: 'put', resource: 'gamma', key: 'k', value: 'late', token: 2 },
          { op: 'check', resource: 'beta', token: 7 },
        ]),
        (error) => {
          assert.ok(error instanceof fencegate.StaleToken);
          assert.ok(!(error instanceof fencegate.TransientError));
          assert.equal(error.status, 409);
          assert.deepEqual(
            [...error.stale].sort((a, b) => a.resource.localeCompare(b.resource)),
            [
              { resource: 'beta', presented: 7n, highest: 8n },
              { resource: 'gamma', presented: 2n, highest: 9n },
            ],
          );
          const first = error.stale[0];
          assert.deepEqual([error.resource, error.presented, error.highest], [first?.resource, first?.presented, first?.highest]);
          return true;
        },
      );
      assert.deepEqual(await read(gateway, 'alpha', 'k'), ['before', 1], 'nothing of a refused transaction is applied');
      assert.equal(await read(gateway, 'gamma', 'k'), null);
      assert.equal((await gateway.fence('delta')).highest, null);
      assert.deepEqual([(await gateway.fence('alpha')).highest, (await gateway.fence('beta')).highest], [3n, 8n]);
    });

    test('a failed precondition names its operation and applies nothing', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      await gateway.put('jobs', 'j-1', 'queued', { token: 2 });
      await assert.rejects(
        gateway.txn([
          { op: 'advance', resource: 'queue', token: 2 },
          { op: 'put', resource: 'jobs', key: 'j-2', value: 'new', token: 2, ifMatch: 0 },
          { op: 'put', resource: 'jobs', key: 'j-1', value: 'running', token: 2, ifMatch: 7 },
          { op: 'check', resource: 'config', token: 1, key: 'limits', version: 1 },
        ]),
        (error) => {
          assert.ok(error instanceof fencegate.VersionMismatch);
          assert.deepEqual([error.status, error.operation, error.current], [412, 2, 1]);
          return true;
        },
      );
      assert.deepEqual(await read(gateway, 'jobs', 'j-1'), ['queued', 1]);
      assert.equal(await read(gateway, 'jobs', 'j-2'), null);
      assert.equal((await gateway.fence('queue')).highest, null);
      await assert.rejects(gateway.txn([{ op: 'check', resource: 'config', token: 1, key: 'limits', version: 1 }]), (error) => {
        assert.ok(error instanceof fencegate.VersionMismatch);
        assert.deepEqual([error.operation, error.current], [0, null]);
        return true;
      });
    });

    test('what is not a transaction is refused before anything runs', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      await assert.rejects(
        gateway.txn([
          { op: 'advance', resource: 'a', token: 1 },
          { op: 'put', resource: 'b', key: 'k', value: 'v', token: 1 },
          { op: 'delete', resource: 'b', key: 'k', token: 1 },
        ]),
        (error) => {
          assert.ok(error instanceof fencegate.InvalidTransaction);
          assert.deepEqual([error.status, error.operation], [400, 2]);
          return true;
        },
      );
      await assert.rejects(
        gateway.txn([
          { op: 'advance', resource: 'a', token: 1 },
          { op: 'advance', resource: 'a', token: 2 },
        ]),
        fencegate.InvalidTransaction,
      );
      await assert.rejects(gateway.txn([]), fencegate.InvalidTransaction);
      assert.equal((await gateway.fence('a')).highest, null);
      assert.equal(await gateway.get('b', 'k'), null);
      await assert.rejects(gateway.txn([{ op: 'advance', resource: 'a', token: 0 }]), /fencing token/);
      await assert.rejects(gateway.txn([{ op: 'check', resource: 'a', token: 1, key: 'k' }]), /both key and version/);
      await assert.rejects(
        gateway.txn([{ op: 'rename', resource: 'a', token: 1 } as unknown as fencegate.TxnOperation]),
        TypeError,
      );
    });

    test('too many operations', async (t) => {
      const process = await gatewayOn(t, backend, '--txn-max-operations', '2');
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      const advances = (count: number): fencegate.TxnOperation[] =>
        Array.from({ length: count }, (_, i) => ({ op: 'advance', resource: `r${i}`, token: 1 }));
      await assert.rejects(gateway.txn(advances(3)), (error) => {
        assert.ok(error instanceof fencegate.TooManyOperations);
        assert.deepEqual([error.status, error.limit], [400, 2]);
        return true;
      });
      assert.equal((await gateway.txn(advances(2))).results.length, 2);
    });

    test('a keyed transaction is applied once', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      const operations: fencegate.TxnOperation[] = [
        { op: 'put', resource: 'ledger', key: 'entry-1', value: 'debit 10', token: 1, ifMatch: 0 },
        { op: 'advance', resource: 'audit', token: 1 },
      ];
      const first = await gateway.txn(operations, { idempotencyKey: 'move-entry-1' });
      const again = await gateway.txn(operations, { idempotencyKey: 'move-entry-1' });
      assert.deepEqual([first.replayed, again.replayed], [false, true]);
      assert.deepEqual(first.results, again.results);
      assert.deepEqual(await read(gateway, 'ledger', 'entry-1'), ['debit 10', 1]);
      await assert.rejects(
        gateway.txn(operations.slice(0, 1), { idempotencyKey: 'move-entry-1' }),
        fencegate.IdempotencyKeyReused,
      );
    });

    test('a stale transaction ends the terms it names', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-b' });
      defer(t, () => gateway.close());
      const shard = gateway.lease('shard-7', { ttlMs: 30_000 });
      const queue = gateway.lease('queue-7', { ttlMs: 30_000 });
      assert.ok((await shard.acquire({ wait: false })) && (await queue.acquire({ wait: false })));
      defer(t, () => Promise.all([shard.release(), queue.release()]));

      const done = await gateway.txn(
        [
          { op: 'put', resource: 'shard-7', key: 'owner', value: 'node-b', token: shard.token },
          { op: 'advance', resource: 'queue-7', token: queue.token },
        ],
        { leases: [shard, queue] },
      );
      assert.deepEqual(done.results.map((result) => result.token), [shard.token, queue.token]);

      await gateway.advance('queue-7', { token: queue.token + 1n }); // a newer term of the queue
      await assert.rejects(
        gateway.txn(
          [
            { op: 'put', resource: 'shard-7', key: 'owner', value: 'node-c', token: shard.token },
            { op: 'advance', resource: 'queue-7', token: queue.token },
          ],
          { leases: [shard, queue] },
        ),
        (error) => {
          assert.ok(error instanceof fencegate.StaleToken);
          assert.deepEqual(error.stale.map((item) => item.resource), ['queue-7']);
          return true;
        },
      );
      assert.equal(queue.reason, 'stale_token');
      assert.ok(shard.held, 'a term the refusal does not name goes on');
      await assert.rejects(
        gateway.txn([{ op: 'put', resource: 'shard-7', key: 'owner', value: 'node-c', token: shard.token }], {
          leases: [shard, queue],
        }),
        fencegate.LeaseLost,
      );
      assert.deepEqual(await read(gateway, 'shard-7', 'owner'), ['node-b', 1]);
    });
  });
}
