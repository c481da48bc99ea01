/** Lease against the real gateway, with a TTL of one second, on both backends. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import * as fencegate from 'fencegate';

import { BACKENDS, defer, eventually, gatewayOn, Hop } from './harness.js';

const TTL_MS = 1_000;

/** The error a promise rejects with; fails if it resolves. */
async function rejection(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    () => assert.fail('resolved where a rejection was expected'),
    (error: unknown) => error,
  );
}

for (const backend of BACKENDS) {
  describe(`on the ${backend} backend`, () => {
    test('a held lease renews and keeps its token', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await lease.acquire());
      const token = lease.token;
      // Three TTLs: without renewals the lease would have passed twice over.
      for (let i = 0; i < 6; i += 1) {
        await sleep(TTL_MS / 2);
        assert.ok(lease.held && !lease.signal.aborted);
        const state = await gateway.readLease('sweeper');
        assert.deepEqual([state.held, state.holder, state.token], [true, 'node-a', token]);
        await assert.rejects(gateway.acquireLease('sweeper', { holder: 'node-b', ttlMs: TTL_MS }), fencegate.LeaseHeld);
      }
      assert.equal((await lease.put('k', 'v')).token, token);
      await lease.release();
      assert.equal(lease.reason, 'released');
      assert.ok(lease.signal.reason instanceof fencegate.LeaseLost);
      // Released: a rival takes over at once, with the next token.
      assert.equal((await gateway.acquireLease('sweeper', { holder: 'node-b', ttlMs: TTL_MS })).token, token + 1n);
    });

    test('seed timeline: a paused leader is refused and loses its term', async (t) => {
      const process = await gatewayOn(t, backend);
      const hop = await Hop.open(t, process.addr);
      const gatewayA = new fencegate.Gateway(hop.url, { holder: 'node-a' });
      const gatewayB = new fencegate.Gateway(process.url, { holder: 'node-b' });
      defer(t, () => {
        gatewayA.close();
        gatewayB.close();
      });
      const a = gatewayA.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await a.acquire({ wait: false }));
      const ended: fencegate.LostReason[] = [];
      a.onLost((reason) => ended.push(reason));
      await a.put('state', 'from A, before the pause');

      hop.hold(); // A freezes: its renewals and its next write sit in the network
      const lateWrite = rejection(a.put('state', 'from A, late'));

      const b = gatewayB.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await b.acquire({ timeoutMs: 5_000 }), 'B never got the lease');
      assert.ok(a.signal.aborted, 'A had not stepped down when B took over');
      assert.equal(a.reason, 'deadline');
      assert.equal(b.token, a.token + 1n);
      await b.put('state', 'from B');

      hop.release(); // A's delayed write arrives
      const refused = await lateWrite;
      assert.ok(refused instanceof fencegate.StaleToken);
      assert.deepEqual([refused.resource, refused.presented, refused.highest], ['sweeper', a.token, b.token]);
      assert.deepEqual(ended, ['deadline']);

      const stored = await gatewayB.get('sweeper', 'state');
      assert.deepEqual([stored?.text(), stored?.token], ['from B', b.token]);
      const after = await rejection(a.put('state', 'after the end'));
      assert.ok(after instanceof fencegate.LeaseLost);
      assert.equal(after.status, undefined, 'refused here, never sent');
      await b.release();
    });

    test('a stale rejection ends the term at once', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs: 30_000 });
      assert.ok(await lease.acquire({ wait: false }));
      const reasons: fencegate.LostReason[] = [];
      lease.onLost((reason) => reasons.push(reason));
      await gateway.advance('sweeper', { token: lease.token + 1n }); // a newer term, elected elsewhere
      const refused = await rejection(lease.put('k', 'v'));
      assert.ok(refused instanceof fencegate.StaleToken);
      assert.equal(refused.highest, lease.token + 1n);
      assert.ok(lease.signal.aborted);
      assert.deepEqual(reasons, ['stale_token']);
      assert.equal(lease.remaining(), 0);
      await assert.rejects(lease.put('k', 'v'), fencegate.LeaseLost);
      const late: fencegate.LostReason[] = [];
      lease.onLost((reason) => late.push(reason)); // registered after the end: called at once
      assert.deepEqual(late, ['stale_token']);
      await lease.release();
    });

    test('lease_lost from a renewal ends the term, and run() rejects', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
      defer(t, () => gateway.close());
      const first = gateway.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await first.acquire({ wait: false }));
      let stopped = false;
      const running = first.run(async (signal) => {
        await sleep(60_000, undefined, { signal }).catch(() => {
          stopped = true;
        });
        return 'finished';
      });
      // The same holder name acquires again (a restarted process): a new term.
      const second = gateway.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await second.acquire({ wait: false }));
      const started = performance.now();
      const error = await rejection(running);
      assert.ok(error instanceof fencegate.LeaseLost);
      assert.ok(performance.now() - started < TTL_MS, 'the old term outlived a renewal');
      assert.equal(first.reason, 'lease_lost');
      await eventually(() => stopped);
      assert.ok(second.held);
      await second.release();
    });

    test('steps down on its own clock before the lease can pass', async (t) => {
      const process = await gatewayOn(t, backend);
      const hop = await Hop.open(t, process.addr);
      const gateway = new fencegate.Gateway(hop.url, { holder: 'node-a' });
      const direct = new fencegate.Gateway(process.url);
      defer(t, () => {
        gateway.close();
        direct.close();
      });
      const lease = gateway.lease('sweeper', { ttlMs: TTL_MS, marginMs: 500 });
      const sent = performance.now();
      assert.ok(await lease.acquire({ wait: false }));
      hop.hold(); // renewals stop getting through
      await new Promise((resolve) => lease.signal.addEventListener('abort', resolve, { once: true }));
      const steppedDown = performance.now() - sent;
      const state = await direct.readLease('sweeper'); // still held on the gateway's clock
      assert.equal(lease.reason, 'deadline');
      assert.ok(steppedDown >= TTL_MS - 500 - 50 && steppedDown < TTL_MS, `stepped down after ${steppedDown} ms`);
      assert.deepEqual([state.held, state.holder], [true, 'node-a']);
      hop.release();
    });

    test('a waiting acquire takes over when the holder releases', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      const holder = gateway.lease('sweeper', { holder: 'node-a', ttlMs: TTL_MS });
      assert.ok(await holder.acquire());
      const follower = gateway.lease('sweeper', { holder: 'node-b', ttlMs: TTL_MS });
      assert.equal(await follower.acquire({ wait: false }), false);
      assert.equal(await follower.acquire({ timeoutMs: 200 }), false);
      setTimeout(() => void holder.release(), 300);
      const started = performance.now();
      assert.ok(await follower.acquire({ timeoutMs: 5_000 }));
      assert.ok(performance.now() - started < 1_000, 'the follower did not see the release');
      assert.equal(follower.token, holder.token + 1n);
      await assert.rejects(follower.acquire(), /one term/);
      await follower.release();
    });
  });
}
