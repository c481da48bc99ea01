/** A gateway or a database that is down: transient errors, never a false `lost`. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import * as fencegate from 'fencegate';

import { BACKENDS, closedPort, defer, dropDatabase, eventually, fencedDatabase, gatewayOn, startGateway } from './harness.js';

test('no gateway is a transient error, and nothing was applied', async () => {
  const gateway = new fencegate.Gateway(`http://127.0.0.1:${await closedPort()}`, { timeoutMs: 2_000 });
  await assert.rejects(gateway.put('orders', 'o-1', 'v', { token: 1 }), (error) => {
    assert.ok(error instanceof fencegate.GatewayUnreachable);
    assert.ok(error instanceof fencegate.TransientError);
    assert.ok(!(error instanceof fencegate.FenceError));
    assert.equal(error.writeApplied, false, 'the connection was refused: nothing was sent');
    assert.equal(error.status, undefined);
    return true;
  });
  gateway.close();
});

test('ready() is false without a gateway, and throws only for a mistake in the code', async () => {
  const gateway = new fencegate.Gateway(`http://127.0.0.1:${await closedPort()}`);
  assert.equal(await gateway.ready(), false);
  gateway.close();
  assert.throws(() => new fencegate.Gateway('ftp://127.0.0.1:7070'), /http:\/\/ or https:\/\//);
});

for (const backend of BACKENDS) {
  describe(`on the ${backend} backend`, () => {
    test('ready() is false while the gateway is paused or stopped', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { timeoutMs: 500 });
      defer(t, () => gateway.close());
      assert.equal(await gateway.ready(), true);
      process.pause();
      try {
        const started = performance.now();
        assert.equal(await gateway.ready(), false, 'a paused gateway is not ready');
        assert.ok(performance.now() - started < 2_000, "ready() waited past the gateway's timeoutMs");
        assert.equal(await gateway.ready({ timeoutMs: 100 }), false);
      } finally {
        process.resume();
      }
      assert.equal(await gateway.ready(), true);
      await process.stop();
      assert.equal(await gateway.ready(), false, 'a stopped gateway is not ready');
    });

    test('a hung gateway leaves the write in doubt', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { timeoutMs: 300 });
      defer(t, () => gateway.close());
      await gateway.put('orders', 'o-1', 'v', { token: 1 }); // the connection is open now
      process.pause();
      try {
        await assert.rejects(gateway.put('orders', 'o-1', 'v2', { token: 1 }), (error) => {
          assert.ok(error instanceof fencegate.GatewayUnreachable);
          assert.equal(error.writeApplied, null, 'sent and unanswered: it may have been applied');
          return true;
        });
      } finally {
        process.resume();
      }
    });

    test('a lease rides out a gateway restart without a false lost', async (t) => {
      const ttlMs = 3_000; // renewals every 1 s, step-down 2.6 s after the last one that got through
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-a', timeoutMs: 1_000 });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs });
      assert.ok(await lease.acquire({ wait: false }));
      const token = lease.token;
      await process.kill();
      const downAt = performance.now();
      await assert.rejects(lease.put('k', 'while down'), fencegate.GatewayUnreachable);
      assert.ok(!lease.signal.aborted, 'a gateway that is down is no reason to stop');
      await sleep(Math.max(0, downAt + 1_200 - performance.now())); // at least one renewal fails meanwhile
      assert.ok(!lease.signal.aborted);
      await process.start(process.addr);
      // Past the deadline the term would have had without a renewal after the crash.
      await sleep(Math.max(0, downAt + ttlMs - performance.now()));
      assert.ok(lease.held && !lease.signal.aborted);
      assert.equal((await lease.put('k', 'after the restart')).token, token);
      assert.equal((await gateway.readLease('sweeper')).token, token);
      await lease.release();
      assert.equal(lease.reason, 'released');
    });

    test('a lease steps down when the gateway stays down', async (t) => {
      const ttlMs = 1_500;
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-a', timeoutMs: 1_000 });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs });
      assert.ok(await lease.acquire({ wait: false }));
      await process.kill();
      const killed = performance.now();
      await new Promise((resolve) => lease.signal.addEventListener('abort', resolve, { once: true }));
      assert.equal(lease.reason, 'deadline');
      assert.ok(performance.now() - killed < ttlMs, 'it stepped down after the lease could have passed');
      await assert.rejects(lease.put('k', 'v'), fencegate.LeaseLost);
      await lease.release(); // the gateway is gone: a release that fails is no error
    });
  });
}

test('a database that goes away is backend_unavailable', async (t) => {
  const db = await fencedDatabase(t);
  const process = await startGateway(t, ['--database-url', db.adminUrl, '--backend-timeout', '1s']);
  // Sent once: each attempt waits out --backend-timeout, and resending would outlast the
  // term, which is what this test watches.
  const gateway = new fencegate.Gateway(process.url, { holder: 'node-a', retry: fencegate.NO_RETRY });
  defer(t, () => gateway.close());
  const lease = gateway.lease('sweeper', { ttlMs: 3_000 });
  assert.ok(await lease.acquire({ wait: false }));
  await lease.put('k', 'v');
  await dropDatabase(db.name);
  await assert.rejects(lease.put('k', 'v2'), (error) => {
    assert.ok(error instanceof fencegate.BackendUnavailable);
    assert.ok(error instanceof fencegate.TransientError && !(error instanceof fencegate.FenceError));
    assert.equal(error.status, 503);
    assert.ok(error.writeApplied === false || error.writeApplied === null);
    return true;
  });
  assert.ok(!lease.signal.aborted, 'a database that is down is no reason to stop yet');
  assert.equal(await gateway.ready(), false);
  await eventually(() => lease.signal.aborted, 4_000);
  assert.equal(lease.reason, 'deadline');
});
