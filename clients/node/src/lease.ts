/**
 * Leases hosted by the gateway, held for one term.
 *
 * A `Lease` is one term. Acquiring it mints a new fencing token and raises the
 * resource's fence to it in the same step, so the term's first write needs no advance
 * and the previous term's late writes are refused from then on. While held it renews
 * itself every `renewEveryMs` (a third of the TTL by default).
 *
 * ## Timing
 *
 * The holder's own monotonic clock (`performance.now()`) decides when to stop. Each
 * successful renewal moves the **deadline** to the instant the renewal was *sent*, plus
 * the TTL (or what the gateway granted, if less), less `marginMs` (2/15 of the TTL by
 * default: 2 s of 15 s). The gateway starts the TTL when the request arrives, later than
 * it was sent, so the holder stops at least `marginMs` before any rival can take over,
 * whatever the network did.
 *
 * A renewal that fails is tried again every `renewRetryEveryMs` (1/30 of the TTL) until
 * the deadline, each attempt abandoned after `renewTimeoutMs` (1/15 of the TTL) or at the
 * deadline, whichever comes first. So a gateway that hangs (its database failing over)
 * cannot use up the time left with one request, and the last attempt is sent shortly
 * before the deadline: a lease whose database is back in time is kept. `marginMs` must
 * stay above `renewTimeoutMs`, so that an attempt sent just before the deadline reaches
 * the gateway before the lease can pass there.
 *
 * ## The end of the term
 *
 * `signal` (an `AbortSignal`) aborts, with a {@link LeaseLost} as its `reason`, on the
 * first of: `409 lease_lost` from a renewal; `409 stale_token` (or `ZF001` in a fenced
 * transaction) from any call made through the lease; the deadline passing without a
 * successful renewal (a gateway that is down is a transient error and never ends the
 * term by itself, but the holder cannot vouch for longer than the deadline that nobody
 * else holds the lease); {@link Lease.release}. After that every call through the lease
 * throws {@link LeaseLost} without being sent. To lead again, acquire a new lease.
 *
 * @module
 */

import { setTimeout as sleep } from 'node:timers/promises';

import { FencegateError, LeaseHeld, LeaseLost, StaleToken, TransientError } from './errors.js';
import { type Queryable, fencedTransaction } from './fenced.js';
import type { Gateway } from './gateway.js';
import * as proto from './protocol.js';
import type {
  Answer,
  FenceState,
  IfMatch,
  LeaseState,
  Request,
  SqlOutcome,
  StatementLike,
  StoredObject,
  TokenLike,
  WriteResult,
} from './protocol.js';
import { checkTtl } from './protocol.js';
import { NO_RETRY, STALE, WRITE } from './retry.js';

/** Why a term ended. */
export type LostReason =
  /** The gateway or Postgres refused a call made under the term: a newer term wrote. */
  | 'stale_token'
  /** The gateway said the lease is no longer held at the term's token. */
  | 'lease_lost'
  /** No renewal succeeded before the deadline: stepped down on the holder's clock. */
  | 'deadline'
  /** Released by its holder. */
  | 'released';

/**
 * A lease's timing, in milliseconds. Every default is a fraction of `ttlMs`, the same in
 * every fencegate client; for a 15 s lease: renew every 5 s; step down 13 s after the
 * last renewal that got through was sent, 2 s before a rival may acquire; after a failed
 * renewal, try again every 0.5 s, each attempt given at most 1 s.
 */
export interface LeaseOptions {
  /** How long each acquisition or renewal holds on the gateway's clock (15 s). */
  ttlMs?: number | undefined;
  /** How long before the TTL could pass the holder steps down (`ttlMs * 2 / 15`); above `renewTimeoutMs`. */
  marginMs?: number | undefined;
  /** Time between renewals (`ttlMs / 3`); below `ttlMs - marginMs`. */
  renewEveryMs?: number | undefined;
  /** Time between tries to acquire a lease someone else holds (`min(renewEveryMs, ttlMs / 10)`). */
  retryEveryMs?: number | undefined;
  /** Time between renewal attempts after a failed one, until the deadline (`ttlMs / 30`). */
  renewRetryEveryMs?: number | undefined;
  /** The longest one renewal attempt may take (`ttlMs / 15`; less when the deadline is nearer). */
  renewTimeoutMs?: number | undefined;
}

/** A checked timing. */
export interface LeaseTiming {
  readonly ttlMs: number;
  readonly marginMs: number;
  readonly renewEveryMs: number;
  readonly retryEveryMs: number;
  readonly renewRetryEveryMs: number;
  readonly renewTimeoutMs: number;
}

/** Fills in the defaults and checks that the timing can work. */
export function leaseTiming(options: LeaseOptions = {}): LeaseTiming {
  const ttlMs = checkTtl(options.ttlMs ?? 15_000);
  const marginMs = options.marginMs ?? (ttlMs * 2) / 15;
  const renewEveryMs = options.renewEveryMs ?? ttlMs / 3;
  const retryEveryMs = options.retryEveryMs ?? Math.min(renewEveryMs, ttlMs / 10);
  const renewRetryEveryMs = options.renewRetryEveryMs ?? ttlMs / 30;
  const renewTimeoutMs = options.renewTimeoutMs ?? ttlMs / 15;
  if (!(marginMs > 0 && marginMs < ttlMs)) {
    throw new RangeError(`marginMs must be above 0 and below ttlMs (${ttlMs}), not ${marginMs}`);
  }
  if (!(renewEveryMs > 0 && renewEveryMs < ttlMs - marginMs)) {
    throw new RangeError(
      `renewEveryMs must be above 0 and below ttlMs - marginMs (${ttlMs - marginMs}), ` +
        `or the lease would step down before it renews; not ${renewEveryMs}`,
    );
  }
  if (!(retryEveryMs > 0)) throw new RangeError(`retryEveryMs must be above 0, not ${retryEveryMs}`);
  if (!(renewRetryEveryMs > 0)) throw new RangeError(`renewRetryEveryMs must be above 0, not ${renewRetryEveryMs}`);
  if (!(renewTimeoutMs > 0)) throw new RangeError(`renewTimeoutMs must be above 0, not ${renewTimeoutMs}`);
  if (!(marginMs > renewTimeoutMs)) {
    throw new RangeError(
      `marginMs (${marginMs}) must be above renewTimeoutMs (${renewTimeoutMs}): a renewal sent just before ` +
        'the holder steps down must be able to reach the gateway before the lease can pass there; ' +
        'raise marginMs or lower renewTimeoutMs',
    );
  }
  return { ttlMs, marginMs, renewEveryMs, retryEveryMs, renewRetryEveryMs, renewTimeoutMs };
}

/** Longest wait for a release on the way out: an unreleased lease just expires. */
const RELEASE_TIMEOUT_MS = 2_000;

const now = (): number => performance.now();

/**
 * One term of a lease hosted by the gateway. Make one with {@link Gateway.lease}.
 *
 * @example
 * ```ts
 * const lease = gateway.lease('sweeper', { holder: 'node-a', ttlMs: 15_000 });
 * await lease.acquire();
 * try {
 *   while (!lease.signal.aborted) {
 *     await lease.put('invoice-1/reminder', 'sent');
 *     await setTimeout(1000, undefined, { signal: lease.signal }).catch(() => {});
 *   }
 * } finally {
 *   await lease.release();
 * }
 * ```
 */
export class Lease {
  readonly gateway: Gateway;
  /** The lease's name, which is also the resource it fences. */
  readonly resource: string;
  readonly holder: string;
  readonly timing: LeaseTiming;
  /** Aborted when the term ends; its `reason` is a {@link LeaseLost}. */
  readonly signal: AbortSignal;

  readonly #controller = new AbortController();
  #token: bigint | undefined;
  #deadline = Number.NEGATIVE_INFINITY;
  #reason: LostReason | undefined;
  #renewTimer: NodeJS.Timeout | undefined;
  #deadlineTimer: NodeJS.Timeout | undefined;

  constructor(gateway: Gateway, resource: string, holder: string, options: LeaseOptions = {}) {
    this.gateway = gateway;
    this.resource = resource;
    this.holder = holder;
    this.timing = leaseTiming(options);
    this.signal = this.#controller.signal;
  }

  /** The fencing token of this term (the same for the whole term). */
  get token(): bigint {
    if (this.#token === undefined) throw new Error('the lease has not been acquired');
    return this.#token;
  }

  /** Why the term ended; `undefined` while it lasts. */
  get reason(): LostReason | undefined {
    return this.#reason;
  }

  /** Whether the term lasts: acquired, not ended, deadline not passed. */
  get held(): boolean {
    return this.#token !== undefined && this.#reason === undefined && now() < this.#deadline;
  }

  /** Milliseconds until the holder steps down unless a renewal succeeds; 0 when not held. */
  remaining(): number {
    return this.held ? this.#deadline - now() : 0;
  }

  /** Calls `callback(reason)` when the term ends; at once if it has ended. */
  onLost(callback: (reason: LostReason) => void): void {
    const call = (): void => {
      try {
        callback(this.#reason ?? 'deadline');
      } catch (error) {
        process.emitWarning(error instanceof Error ? error : String(error), 'FencegateLeaseCallbackWarning');
      }
    };
    if (this.signal.aborted) call();
    else this.signal.addEventListener('abort', call, { once: true });
  }

  /**
   * The term's token if the term lasts; throws {@link LeaseLost} otherwise. The clock is
   * read here too, so a busy event loop that delayed the deadline timer cannot let a
   * write out after the deadline.
   */
  check(): bigint {
    const token = this.token;
    if (this.#reason === undefined && now() >= this.#deadline) this.#end('deadline');
    if (this.#reason !== undefined) throw this.signal.reason as LeaseLost;
    return token;
  }

  /**
   * Acquires the lease. Waiting (the default), it tries every `retryEveryMs` until the
   * lease is free, riding out transient errors, or until `timeoutMs` passes or `signal`
   * aborts; otherwise it tries once: one acquisition, resent with its `Idempotency-Key`
   * as the gateway's {@link RetryPolicy} says, so that a lost answer cannot mint a
   * second token. Resolves to whether it was acquired; rejects with other errors (for
   * example {@link Forbidden}).
   */
  async acquire(options: { wait?: boolean; timeoutMs?: number; signal?: AbortSignal } = {}): Promise<boolean> {
    if (this.#token !== undefined) {
      throw new Error('a Lease is one term and was acquired already: make a new one to lead again');
    }
    const wait = options.wait ?? true;
    const giveUp = options.timeoutMs === undefined ? Number.POSITIVE_INFINITY : now() + options.timeoutMs;
    for (;;) {
      const sent = now();
      let pause: number;
      try {
        const state = await this.gateway.acquireLease(this.resource, { holder: this.holder, ttlMs: this.timing.ttlMs });
        this.#begin(state, sent);
        return true;
      } catch (error) {
        if (error instanceof LeaseHeld) {
          if (!wait) return false;
          pause = Math.min(this.timing.retryEveryMs, error.expiresInMs ?? Number.POSITIVE_INFINITY);
          // Jitter, so that followers do not all ask at the same instant.
          pause = Math.max(pause, 1) * (1 + Math.random() * 0.2);
        } else if (error instanceof TransientError && wait) {
          pause = this.timing.retryEveryMs;
        } else {
          throw error;
        }
      }
      const left = giveUp - now();
      if (left <= 0) return false;
      await sleep(Math.min(pause, left), undefined, options.signal === undefined ? {} : { signal: options.signal });
    }
  }

  /**
   * Ends the term and gives the lease up, so that a rival may take it at once. Nothing
   * more is sent under the term once this begins; a release that fails is no error (the
   * lease then expires after its TTL).
   */
  async release(): Promise<void> {
    const token = this.#token;
    const reason = this.#reason;
    if (token === undefined) return;
    this.#end('released');
    // After a step-down on the deadline the gateway may still count the lease ours.
    if (reason === undefined || reason === 'deadline') {
      try {
        await this.#step('release', token, RELEASE_TIMEOUT_MS);
      } catch (error) {
        if (!(error instanceof FencegateError)) throw error;
      }
    }
  }

  /**
   * Runs `work` with the term's signal, and settles as soon as the term ends: with
   * `work`'s result, or rejected with {@link LeaseLost} (pass the signal on to what
   * `work` awaits, so that it stops too).
   */
  run<T>(work: (signal: AbortSignal) => Promise<T>): Promise<T> {
    try {
      this.check();
    } catch (error) {
      return Promise.reject(error);
    }
    const signal = this.signal;
    return new Promise<T>((resolve, reject) => {
      const onEnd = (): void => reject(signal.reason);
      signal.addEventListener('abort', onEnd, { once: true });
      work(signal)
        .then(resolve, reject)
        .finally(() => signal.removeEventListener('abort', onEnd));
    });
  }

  // -- the background

  #begin(state: LeaseState, sent: number): void {
    if (state.token === null) throw new FencegateError('the gateway granted a lease without a token');
    this.#token = state.token;
    this.#extend(state, sent);
    this.#scheduleRenewal(this.timing.renewEveryMs);
  }

  #extend(state: LeaseState, sent: number): void {
    const holds = Math.min(this.timing.ttlMs, state.expiresInMs);
    this.#deadline = Math.max(this.#deadline, sent + holds - this.timing.marginMs);
    clearTimeout(this.#deadlineTimer);
    this.#deadlineTimer = setTimeout(() => this.#onDeadline(), Math.max(0, this.#deadline - now()));
  }

  #onDeadline(): void {
    const left = this.#deadline - now();
    if (left > 0) this.#deadlineTimer = setTimeout(() => this.#onDeadline(), left);
    else this.#end('deadline');
  }

  #scheduleRenewal(delayMs: number): void {
    this.#renewTimer = setTimeout(() => void this.#renew(), delayMs);
  }

  /**
   * A renewal or the release, sent once: renewals are retried by `#renew` until the
   * deadline, each with a key of its own, and a release that fails is no error.
   */
  #step(step: 'renew' | 'release', token: TokenLike, timeoutMs: number, ttlMs?: number): Promise<LeaseState> {
    const request = proto.leaseStep(this.resource, step, {
      holder: this.holder,
      token,
      ...(ttlMs === undefined ? {} : { ttlMs }),
    });
    return this.gateway[WRITE](request, proto.leaseState, { retry: NO_RETRY, timeoutMs });
  }

  async #renew(): Promise<void> {
    if (this.#reason !== undefined) return;
    const token = this.token;
    const left = this.#deadline - now();
    if (left <= 0) {
      this.#end('deadline');
      return;
    }
    const sent = now();
    try {
      const timeoutMs = Math.max(1, Math.ceil(Math.min(left, this.timing.renewTimeoutMs)));
      const state = await this.#step('renew', token, timeoutMs, this.timing.ttlMs);
      if (this.#reason !== undefined) return;
      this.#extend(state, sent);
      this.#scheduleRenewal(this.timing.renewEveryMs);
    } catch (error) {
      if (this.#reason !== undefined) return;
      if (error instanceof LeaseLost) {
        this.#end('lease_lost');
        return;
      }
      // Down, slow or refusing: the term lasts until the deadline, and the deadline
      // timer ends it there if no renewal gets through by then. Until then, short
      // attempts at short intervals: the last one is sent close to the deadline, in case
      // the gateway or its database is back by then.
      this.#scheduleRenewal(this.timing.renewRetryEveryMs);
    }
  }

  #end(reason: LostReason): void {
    if (this.#reason !== undefined) return;
    this.#reason = reason;
    clearTimeout(this.#renewTimer);
    clearTimeout(this.#deadlineTimer);
    this.#controller.abort(
      new LeaseLost(`the term of lease ${this.resource} is over (${reason}): acquire a new lease to lead again`, {
        body: { error: LeaseLost.code, resource: this.resource, reason },
      }),
    );
  }

  // -- calls under the term

  /** Ends the term: a transaction under it was refused as stale ({@link Gateway.txn}). */
  [STALE](): void {
    this.#end('stale_token');
  }

  /**
   * Runs a call made with the term's token; a stale or lost answer ends the term.
   */
  async #under<T>(call: (token: bigint) => Promise<T>): Promise<T> {
    const token = this.check();
    try {
      return await call(token);
    } catch (error) {
      if (error instanceof StaleToken) this.#end('stale_token');
      else if (error instanceof LeaseLost) this.#end('lease_lost');
      throw error;
    }
  }

  /** Sends the write made with the term's token, and resends it (same key) only while the term lasts. */
  #write<T>(request: (token: bigint) => Request, parse: (answer: Answer, request: Request) => T): Promise<T> {
    return this.#under((token) => this.gateway[WRITE](request(token), parse, { live: () => this.check() }));
  }

  /** Writes an object of the lease's resource with the term's token. */
  put(
    key: string,
    value: string | Uint8Array,
    options: { ifMatch?: IfMatch; ifNoneMatch?: boolean; idempotencyKey?: string } = {},
  ): Promise<WriteResult> {
    return this.#write(
      (token) => proto.put(this.resource, key, value, { ...options, token }, this.holder),
      proto.writeResult,
    );
  }

  /** Deletes an object of the lease's resource with the term's token. */
  delete(key: string, options: { ifMatch?: IfMatch; idempotencyKey?: string } = {}): Promise<WriteResult> {
    return this.#write((token) => proto.del(this.resource, key, { ...options, token }, this.holder), proto.writeResult);
  }

  /** Reads an object of the lease's resource (no token needed). */
  get(key: string): Promise<StoredObject | null> {
    return this.gateway.get(this.resource, key);
  }

  /** Raises the resource's fence to the term's token. */
  advance(options: { idempotencyKey?: string } = {}): Promise<FenceState> {
    return this.#write((token) => proto.advance(this.resource, { ...options, token }, this.holder), proto.fenceState);
  }

  /** Runs statements after the fence check of the term's token (`/v1/sql`). */
  sql(statements: readonly StatementLike[], options: { idempotencyKey?: string } = {}): Promise<SqlOutcome> {
    return this.#write(
      (token) => proto.sql(this.resource, statements, { ...options, token }, this.holder),
      proto.sqlOutcome,
    );
  }

  /** {@link fencedTransaction} with the term's token; a stale rejection ends the term. */
  transaction<C extends Queryable, T>(client: C, work: (client: C) => Promise<T>): Promise<T> {
    return this.#under((token) => fencedTransaction(client, this.resource, token, work));
  }
}
