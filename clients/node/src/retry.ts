/**
 * Resending writes: one `Idempotency-Key` per logical write, resent only on the answers
 * that decided nothing.
 *
 * ## Behavior
 *
 * - Every write carries an `Idempotency-Key`: the caller's, or a random UUID made once
 *   per call. Every attempt of the call sends the same key and the same request, so the
 *   gateway applies it at most once and answers a late attempt with the first one's
 *   answer.
 * - A write is resent after: no answer ({@link GatewayUnreachable}: refused, reset,
 *   timed out, or a proxy's 502/503/504), `503 backend_unavailable` (`write_applied`
 *   `null` or `false`), `503 overloaded`, `503 shutting_down` and
 *   `409 idempotency_in_flight`. Any other answer is the write's own and is returned or
 *   thrown at once: a `409 stale_token` above all, which ends the term and is never
 *   resent.
 * - At most {@link RetryPolicy.attempts} attempts. Between two, a pause that doubles
 *   from `backoffMs` up to `maxBackoffMs`, with jitter, and never shorter than the
 *   `Retry-After` the gateway asked for.
 * - Under a lease, only while its term lasts: the term is checked before every resend,
 *   and when it is over a {@link LeaseLost} is thrown, with the last transient error as
 *   its `cause`. An aborted `signal` stops the resends too.
 * - The error thrown after the last attempt has `writeApplied: null` if any attempt may
 *   have been applied, and `attempts` set to the number of attempts.
 *
 * @module
 */

import { randomUUID } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';

import {
  BackendUnavailable,
  GatewayUnreachable,
  IdempotencyInFlight,
  IssuerUnavailable,
  LeaseLost,
  NotSynchronouslyReplicated,
  Overloaded,
  ShuttingDown,
  TransientError,
} from './errors.js';

/** How a gateway client resends a write that got no decision. */
export interface RetryPolicy {
  /** Attempts of one write in all, the first included (`1`: never resend). */
  readonly attempts: number;
  /** Milliseconds before the first resend; doubled before each further one. */
  readonly backoffMs: number;
  /** The longest pause between two attempts, unless the gateway asks for more. */
  readonly maxBackoffMs: number;
}

/** Four attempts, 100 ms before the first resend, pauses up to 2 s. */
export const DEFAULT_RETRY: RetryPolicy = Object.freeze({ attempts: 4, backoffMs: 100, maxBackoffMs: 2_000 });

/** Send each write once. */
export const NO_RETRY: RetryPolicy = Object.freeze({ attempts: 1, backoffMs: 0, maxBackoffMs: 0 });

/** Fills in the defaults ({@link DEFAULT_RETRY}) and checks the policy. */
export function retryPolicy(options: Partial<RetryPolicy> = {}): RetryPolicy {
  const attempts = options.attempts ?? DEFAULT_RETRY.attempts;
  const backoffMs = options.backoffMs ?? DEFAULT_RETRY.backoffMs;
  const maxBackoffMs = options.maxBackoffMs ?? Math.max(backoffMs, DEFAULT_RETRY.maxBackoffMs);
  if (!Number.isInteger(attempts) || attempts < 1) {
    throw new RangeError(`attempts is an integer of at least 1, not ${attempts}`);
  }
  if (!(backoffMs >= 0 && backoffMs <= maxBackoffMs)) {
    throw new RangeError(`backoffMs and maxBackoffMs need 0 <= backoffMs <= maxBackoffMs, not ${backoffMs}, ${maxBackoffMs}`);
  }
  return Object.freeze({ attempts, backoffMs, maxBackoffMs });
}

/** The longest `Idempotency-Key` the gateway takes, in bytes. */
export const MAX_IDEMPOTENCY_KEY_LENGTH = 255;

/** A fresh key for one logical write: a random UUID. */
export function newIdempotencyKey(): string {
  return randomUUID();
}

/** The key if the gateway would take it (1 to 255 printable ASCII characters); throws otherwise. */
export function checkIdempotencyKey(key: string): string {
  if (typeof key !== 'string') throw new TypeError(`an Idempotency-Key is a string, not ${typeof key}`);
  if (!/^[\x20-\x7e]{1,255}$/.test(key)) {
    throw new RangeError(`an Idempotency-Key is 1 to ${MAX_IDEMPOTENCY_KEY_LENGTH} printable ASCII characters: ${JSON.stringify(key)}`);
  }
  return key;
}

/** The caller's key, checked, or a fresh one for a new logical write. */
export function keyFor(key: string | undefined): string {
  return key === undefined ? newIdempotencyKey() : checkIdempotencyKey(key);
}

/** What a resend loop is bounded by besides its policy. */
export interface WriteControl {
  /** The writer's term: throws {@link LeaseLost} when it is over. */
  live?: (() => void) | undefined;
  /** Stops the resends (and aborts the request in flight). */
  signal?: AbortSignal | undefined;
}

/** The transient errors after which a write is resent (not `body_timeout`: the same slow request would time out again). */
function resent(error: TransientError): boolean {
  return (
    error instanceof GatewayUnreachable ||
    error instanceof BackendUnavailable ||
    error instanceof Overloaded ||
    error instanceof ShuttingDown ||
    error instanceof NotSynchronouslyReplicated ||
    error instanceof IssuerUnavailable ||
    error instanceof IdempotencyInFlight
  );
}

function pauseMs(policy: RetryPolicy, resend: number, error: TransientError): number {
  // Jitter, so that writers cut off together do not come back together.
  const wait = Math.min(policy.maxBackoffMs, policy.backoffMs * 2 ** (resend - 1)) * (0.5 + Math.random() / 2);
  return Math.max(wait, (error.retryAfter ?? 0) * 1_000);
}

/** `attempt()`, repeated as the policy says; see the module's Behavior. */
export async function send<T>(attempt: () => Promise<T>, policy: RetryPolicy, control: WriteControl = {}): Promise<T> {
  let made = 0;
  let inDoubt = false;
  for (;;) {
    let failure: TransientError;
    try {
      return await attempt();
    } catch (error) {
      if (!(error instanceof TransientError)) throw error;
      made += 1;
      inDoubt ||= error.writeApplied === null;
      error.attempts = made;
      if (inDoubt) error.writeApplied = null; // an earlier attempt may have been applied
      if (!resent(error) || made >= policy.attempts) throw error;
      failure = error;
    }
    const signal = control.signal;
    try {
      await sleep(pauseMs(policy, made, failure), undefined, signal === undefined ? {} : { signal });
    } catch (error) {
      throw signal?.aborted ? signal.reason : error;
    }
    if (control.live !== undefined) {
      try {
        control.live();
      } catch (error) {
        if (!(error instanceof LeaseLost)) throw error;
        throw new LeaseLost(error.message, { body: error.body, cause: failure });
      }
    }
  }
}

/** The key of the gateway's method a {@link Lease} sends its writes through, with its term as `live`. */
export const WRITE: unique symbol = Symbol('fencegate.write');

/** The key of a {@link Lease}'s method that ends its term on a stale refusal seen elsewhere (a transaction). */
export const STALE: unique symbol = Symbol('fencegate.stale');
