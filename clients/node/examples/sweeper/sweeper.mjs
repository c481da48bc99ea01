// @ts-check
/**
 * The seed's invoice sweeper: processes compete for one lease, and the leader writes a
 * reminder per unpaid invoice, every interval, under its term's fencing token.
 *
 * Run a gateway, then two sweepers:
 *
 *     node examples/sweeper/sweeper.mjs --node node-a
 *     node examples/sweeper/sweeper.mjs --node node-b
 *
 * Freeze the leader (`kill -STOP <pid>`) for longer than the TTL: the other one takes
 * over with the next token. Wake it (`kill -CONT <pid>`): it sees on its own clock that
 * its term is over, or has its late write refused, and goes back to waiting. Stop a
 * sweeper with Ctrl-C: it releases the lease, and the other takes over at once.
 */

import { setTimeout as sleep } from 'node:timers/promises';
import { parseArgs } from 'node:util';

import { Gateway, LeaseLost, StaleToken, TransientError } from 'fencegate';

const { values: args } = parseArgs({
  options: {
    gateway: { type: 'string', default: process.env.FENCEGATE_URL ?? 'http://127.0.0.1:7070' },
    node: { type: 'string' },
    lease: { type: 'string', default: 'invoice-sweeper' },
    'ttl-ms': { type: 'string', default: '15000' },
    'interval-ms': { type: 'string', default: '1000' },
    invoices: { type: 'string', default: '3' },
  },
});
if (args.node === undefined) {
  console.error('usage: sweeper.mjs --node NAME [--gateway URL] [--lease NAME] [--ttl-ms N] [--interval-ms N]');
  process.exit(2);
}
const node = args.node;
const intervalMs = Number(args['interval-ms']);
const invoices = Number(args.invoices);

/** @param {string} message */
const say = (message) => console.log(message);

/**
 * Sweeps until the term ends, for whatever reason.
 *
 * @param {import('fencegate').Lease} lease
 */
async function lead(lease) {
  say(`${node}: leading with token ${lease.token}`);
  for (let round = 1; !lease.signal.aborted; round += 1) {
    try {
      for (let number = 1; number <= invoices; number += 1) {
        const key = `invoice-${String(number).padStart(3, '0')}/reminder`;
        const written = await lease.put(key, `reminder sent by ${node} (token ${lease.token}, sweep ${round})`);
        say(`${node}: ${key} written with token ${written.token}, version ${written.version}`);
      }
    } catch (error) {
      if (error instanceof StaleToken) {
        // A newer term has written: stop this term's work, never retry it.
        say(`${node}: write refused, presented ${error.presented}, highest ${error.highest}`);
        break;
      }
      if (error instanceof LeaseLost) break; // the term ended between two writes
      if (!(error instanceof TransientError)) throw error;
      // Down or busy: the term lasts until its deadline; try again next sweep.
      say(`${node}: transient error, retrying in the next sweep: ${error.message}`);
    }
    await sleep(intervalMs, undefined, { signal: lease.signal }).catch(() => undefined);
  }
  say(`${node}: term of token ${lease.token} over: ${lease.reason}`);
}

const gateway = new Gateway(args.gateway, { key: process.env.FENCEGATE_KEY, holder: node });
/** @type {import('fencegate').Lease | undefined} */
let current;
let stopping = false;
for (const signal of /** @type {const} */ (['SIGINT', 'SIGTERM'])) {
  process.on(signal, () => {
    stopping = true;
    // Releasing ends the term (its signal aborts) and lets a rival take over at once.
    void (current?.release() ?? Promise.resolve()).finally(() => {
      gateway.close();
      process.exit(0);
    });
  });
}

while (!stopping) {
  say(`${node}: waiting for the lease ${args.lease}`);
  current = gateway.lease(args.lease, { ttlMs: Number(args['ttl-ms']) });
  if (await current.acquire()) await lead(current);
  await current.release();
}
