/**
 * Lease timing through an outage: the gateway paused with SIGSTOP, as it hangs while its
 * database fails over, then resumed; on both backends.
 *
 * A TTL of 3 s, with the default fractions: renew every 1 s, step down 0.4 s before the
 * lease could pass (2.6 s after the last renewal that got through was sent), retry a
 * failed renewal every 0.1 s, each attempt given at most 0.2 s. The pause starts just
 * before the first renewal is due, so the whole outage falls between two renewals.
 */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import * as fencegate from 'fencegate';

import { BACKENDS, defer, gatewayOn, Hop } from './harness.js';

const TTL_MS = 3_000;
const TIMING = fencegate.leaseTiming({ ttlMs: TTL_MS });
/** After the acquisition: just before the first renewal is due. */
const PAUSE_AT_MS = TIMING.renewEveryMs - 100;
/** The budget (1.6 s) less a little: attempts after the resume land before the deadline. */
const SHORT_PAUSE_MS = TTL_MS - TIMING.marginMs - TIMING.renewEveryMs - 500;
/** Past `ttlMs - marginMs`: no renewal can get through before the deadline. */
const LONG_PAUSE_MS = TTL_MS - TIMING.marginMs + 300;
const RENEW = 'POST /v1/leases/sweeper/renew';

const sleepUntil = (instant: number): Promise<void> => sleep(Math.max(0, instant - performance.now()));

test('the defaults for a short lease', () => {
  assert.deepEqual(
    [TIMING.renewEveryMs, TIMING.marginMs, TIMING.renewRetryEveryMs, TIMING.renewTimeoutMs],
    [1_000, 400, 100, 200],
  );
});

for (const backend of BACKENDS) {
  describe(`on the ${backend} backend`, () => {
    test('a pause shorter than the budget is ridden out', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await lease.acquire({ wait: false }));
      const acquired = performance.now();
      const firstDeadline = acquired + lease.remaining();
      const ended: fencegate.LostReason[] = [];
      lease.onLost((reason) => ended.push(reason));

      await sleepUntil(acquired + PAUSE_AT_MS);
      process.pause();
      try {
        await sleep(SHORT_PAUSE_MS);
      } finally {
        process.resume();
      }
      const resumed = performance.now();
      assert.ok(resumed < firstDeadline - 2 * TIMING.renewTimeoutMs, 'the pause ran long: the test proves nothing');

      // Past the deadline the acquisition set: only a renewal after the resume keeps the term.
      await sleepUntil(firstDeadline + TIMING.renewEveryMs / 2);
      assert.deepEqual(ended, [], `the term ended: ${ended.join()}`);
      assert.ok(lease.held && !lease.signal.aborted);
      assert.equal((await lease.put('after-the-pause', 'still leading')).token, lease.token);
      const state = await gateway.readLease('sweeper');
      assert.deepEqual([state.held, state.holder, state.token], [true, 'node-a', lease.token]);
      await lease.release();
      assert.deepEqual(ended, ['released']);
    });

    test('a pause past ttl - margin ends the term at the deadline, after attempts until then', async (t) => {
      const process = await gatewayOn(t, backend);
      const hop = await Hop.open(t, process.addr); // to see when each renewal attempt is sent
      const gateway = new fencegate.Gateway(hop.url, { holder: 'node-a' });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs: TTL_MS });
      assert.ok(await lease.acquire({ wait: false }));
      const acquired = performance.now();
      const deadline = acquired + lease.remaining();
      let endedAt: number | undefined;
      const ended = new Promise<void>((resolve) =>
        lease.onLost(() => {
          endedAt = performance.now();
          resolve();
        }),
      );

      await sleepUntil(acquired + PAUSE_AT_MS);
      process.pause();
      const paused = performance.now();
      try {
        const lost = await Promise.race([ended.then(() => true), sleep(LONG_PAUSE_MS, false)]);
        assert.ok(lost, 'the term outlived the pause');
      } finally {
        await sleepUntil(paused + LONG_PAUSE_MS);
        process.resume();
      }

      assert.equal(lease.reason, 'deadline');
      assert.ok(endedAt !== undefined);
      assert.ok(endedAt >= deadline, `stepped down ${(deadline - endedAt).toFixed(1)} ms before the deadline`);
      assert.ok(endedAt < deadline + 200, `stepped down ${(endedAt - deadline).toFixed(1)} ms after the deadline`);

      const attempts = hop.sentAt(RENEW).filter((at) => at > paused);
      // Every renewTimeoutMs + renewRetryEveryMs (0.3 s) from the first renewal to the
      // deadline: about five. Several, none that waited for the deadline, the last close to it.
      assert.ok(attempts.length >= 4, `renewal attempts while paused: ${attempts.join()}`);
      const gaps = attempts.slice(1).map((at, index) => at - attempts[index]!);
      assert.ok(
        Math.max(...gaps) < TIMING.renewTimeoutMs + TIMING.renewRetryEveryMs + 250,
        `gaps between attempts: ${gaps.map((gap) => gap.toFixed(0)).join()}`,
      );
      const last = attempts.at(-1)!;
      assert.ok(last < deadline);
      assert.ok(
        deadline - last <= 2 * TIMING.renewTimeoutMs,
        `the last attempt came ${(deadline - last).toFixed(0)} ms before the deadline`,
      );
      await assert.rejects(lease.put('k', 'after the end'), fencegate.LeaseLost);
    });
  });
}
