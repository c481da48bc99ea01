/**
 * The client of the gateway's HTTP API.
 *
 * ## Writes and retries
 *
 * Every write (objects, advances, `/v1/sql`, lease steps, transactions) is one logical
 * write with one `Idempotency-Key`: the caller's `idempotencyKey`, or a random one made
 * for the call. A write that got no decision (no answer, `503`,
 * `409 idempotency_in_flight`) is sent again with the same key, up to the
 * {@link RetryPolicy}'s attempts, so the gateway applies it at most once; a stale token,
 * a failed precondition or any other answer is the write's own and is never resent.
 * Reads are sent once.
 *
 * @module
 */

import { GatewayUnreachable, StaleToken } from './errors.js';
import { Lease, type LeaseOptions } from './lease.js';
import * as proto from './protocol.js';
import type {
  Answer,
  FenceState,
  LeaseState,
  ObjectWriteOptions,
  PutOptions,
  Request,
  SqlOutcome,
  StatementLike,
  StoredObject,
  TokenLike,
  TxnOperation,
  TxnOutcome,
  WriteOptions,
  WriteResult,
} from './protocol.js';
import { type RetryPolicy, STALE, WRITE, type WriteControl, retryPolicy, send } from './retry.js';
import { type TlsFiles, Transport } from './transport.js';
import { VERSION } from './version.js';

/** Where the gateway listens by default. */
export const DEFAULT_URL = 'http://127.0.0.1:7070';

/** Milliseconds to wait for an answer by default. */
export const DEFAULT_TIMEOUT_MS = 10_000;

/** How to reach and authenticate to a gateway. */
export interface GatewayOptions extends TlsFiles {
  /** A bearer key of an identity of the gateway's `--auth-file`. */
  key?: string | undefined;
  /**
   * The writer's name: sent as `Fencing-Holder` with every write (for the gateway's
   * logs), and the lease holder by default.
   */
  holder?: string | undefined;
  /** Longest wait for an answer, in milliseconds. */
  timeoutMs?: number | undefined;
  /**
   * How a write that got no decision is sent again (default {@link DEFAULT_RETRY}: four
   * attempts; {@link NO_RETRY}: never).
   */
  retry?: Partial<RetryPolicy> | undefined;
}

/** How one step of a hosted lease is sent. */
export interface LeaseStepOptions {
  /** The holder (default: the gateway's `holder`). */
  holder?: string | undefined;
  /** The step's `Idempotency-Key` (default: a fresh random one). */
  idempotencyKey?: string | undefined;
}

/**
 * A client of a fencegate gateway.
 *
 * Every write takes the fencing token of the writer's term, and every error answer is
 * thrown as the class of its code. Writes carry an `Idempotency-Key` and are resent with
 * it when they got no decision (see the module's doc); a stale write never is.
 *
 * @example
 * ```ts
 * const gateway = new Gateway('http://127.0.0.1:7070', { holder: 'node-b' });
 * await gateway.put('orders', 'o-1', 'from 42', { token: 42 });
 * ```
 */
export class Gateway {
  /** The default `Fencing-Holder` and lease holder. */
  readonly holder: string | undefined;
  /** How writes are sent again. */
  readonly retry: RetryPolicy;
  readonly #transport: Transport;

  constructor(url: string = DEFAULT_URL, options: GatewayOptions = {}) {
    const headers: Record<string, string> = { 'user-agent': `fencegate-node/${VERSION}` };
    if (options.key !== undefined) headers['authorization'] = `Bearer ${options.key}`;
    this.holder = options.holder;
    this.retry = retryPolicy(options.retry);
    this.#transport = new Transport(url, headers, options.timeoutMs ?? DEFAULT_TIMEOUT_MS, options);
  }

  /** The gateway's base URL. */
  get url(): string {
    return this.#transport.url;
  }

  /** Closes idle connections. */
  close(): void {
    this.#transport.close();
  }

  async #send<T>(
    request: Request,
    parse: (answer: Answer, request: Request) => T,
    timeoutMs?: number,
    signal?: AbortSignal,
  ): Promise<T> {
    return parse(await this.#transport.send(request, timeoutMs, signal), request);
  }

  /**
   * Sends a write, and sends it again as the policy says (see the module's doc). For
   * {@link Lease}, which passes its term as `live`; not part of the API.
   *
   * @internal
   */
  async [WRITE]<T>(
    request: Request,
    parse: (answer: Answer, request: Request) => T,
    control: WriteControl & { retry?: RetryPolicy | undefined; timeoutMs?: number | undefined } = {},
  ): Promise<T> {
    return await send(
      () => this.#send(request, parse, control.timeoutMs, control.signal),
      control.retry ?? this.retry,
      control,
    );
  }

  /**
   * Writes `value` as the object `resource/key` if the token is current.
   *
   * @throws {@link StaleToken} a newer term has written: stop this term's work.
   * @throws {@link VersionMismatch} the precondition did not hold.
   * @throws {@link TransientError} nothing decided; see `writeApplied`.
   */
  async put(resource: string, key: string, value: string | Uint8Array, options: PutOptions): Promise<WriteResult> {
    return await this[WRITE](proto.put(resource, key, value, options, this.holder), proto.writeResult, { signal: options.signal });
  }

  /** Deletes the object (a missing one is fine) if the token is current. */
  async delete(resource: string, key: string, options: ObjectWriteOptions): Promise<WriteResult> {
    return await this[WRITE](proto.del(resource, key, options, this.holder), proto.writeResult, { signal: options.signal });
  }

  /** Reads an object; `null` if there is none. Needs no token. */
  async get(resource: string, key: string): Promise<StoredObject | null> {
    return await this.#send(proto.get(resource, key), proto.storedObject);
  }

  /** Reads the resource's fence. */
  async fence(resource: string): Promise<FenceState> {
    return await this.#send(proto.fence(resource), proto.fenceState);
  }

  /**
   * Raises the fence to the token without writing, so that writes still in flight from
   * older terms are refused from now on.
   */
  async advance(resource: string, options: WriteOptions): Promise<FenceState> {
    return await this[WRITE](proto.advance(resource, options, this.holder), proto.fenceState, { signal: options.signal });
  }

  /**
   * Runs the writer's statements after the fence check, in one transaction
   * (`POST /v1/sql`; Postgres backend with `--sql`).
   */
  async sql(resource: string, statements: readonly StatementLike[], options: WriteOptions): Promise<SqlOutcome> {
    return await this[WRITE](proto.sql(resource, statements, options, this.holder), proto.sqlOutcome, { signal: options.signal });
  }

  /**
   * Applies `operations` all or none, in one transaction (`POST /v1/txn`).
   *
   * Each operation carries the token of the writer's term on its resource. Every
   * resource's fence is held from its check to the commit, so a checked resource cannot
   * move in between.
   *
   * @example
   * ```ts
   * const { results } = await gateway.txn([
   *   { op: 'put', resource: 'shard-7', key: 'owner', value: 'node-b', token: 12, ifMatch: 4 },
   *   { op: 'delete', resource: 'shard-7', key: 'handoff', token: 12 },
   *   { op: 'advance', resource: 'queue-7', token: 30 },
   *   { op: 'check', resource: 'cluster-config', token: 5, key: 'layout', version: 9 },
   * ]);
   * ```
   *
   * @param options.leases - The terms the tokens belong to: each is checked before every
   *   attempt ({@link LeaseLost} if one is over), and a stale refusal ends the term of
   *   every lease whose resource it names.
   * @returns One result per operation, in order.
   * @throws {@link StaleToken} one resource or more is past its token (`stale` lists
   *   them all); nothing was applied.
   * @throws {@link VersionMismatch} the precondition of operation `operation` did not
   *   hold; nothing was applied.
   * @throws {@link InvalidTransaction} not a transaction (`operation` names the culprit).
   * @throws {@link TooManyOperations} more than the gateway's `--txn-max-operations`.
   */
  async txn(
    operations: readonly TxnOperation[],
    options: { idempotencyKey?: string | undefined; leases?: readonly Lease[] | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<TxnOutcome> {
    const request = proto.txn(operations, options.idempotencyKey);
    const leases = options.leases ?? [];
    const live = leases.length === 0 ? undefined : (): void => leases.forEach((lease) => lease.check());
    live?.();
    try {
      return await this[WRITE](request, proto.txnOutcome, { live, signal: options.signal });
    } catch (error) {
      if (error instanceof StaleToken) {
        const stale = new Set(error.stale.map((item) => item.resource));
        for (const lease of leases) if (stale.has(lease.resource)) lease[STALE]();
      }
      throw error;
    }
  }

  /**
   * Takes the lease if it is free, expired or already the holder's: always a new token,
   * with the resource's fence raised to it.
   *
   * @throws {@link LeaseHeld} another holder holds it.
   */
  async acquireLease(resource: string, options: LeaseStepOptions & { ttlMs: number }): Promise<LeaseState> {
    const request = proto.leaseStep(resource, 'acquire', {
      holder: this.#holder(options.holder),
      ttlMs: options.ttlMs,
      idempotencyKey: options.idempotencyKey,
    });
    return await this[WRITE](request, proto.leaseState);
  }

  /**
   * Extends the lease held at `token`.
   *
   * @throws {@link LeaseLost} the term is over.
   */
  async renewLease(
    resource: string,
    options: LeaseStepOptions & { token: TokenLike; ttlMs: number; timeoutMs?: number | undefined },
  ): Promise<LeaseState> {
    const request = proto.leaseStep(resource, 'renew', {
      holder: this.#holder(options.holder),
      token: options.token,
      ttlMs: options.ttlMs,
      idempotencyKey: options.idempotencyKey,
    });
    return await this[WRITE](request, proto.leaseState, { timeoutMs: options.timeoutMs });
  }

  /** Gives the lease up, so that a rival may take it at once. */
  async releaseLease(
    resource: string,
    options: LeaseStepOptions & { token: TokenLike; timeoutMs?: number | undefined },
  ): Promise<LeaseState> {
    const request = proto.leaseStep(resource, 'release', {
      holder: this.#holder(options.holder),
      token: options.token,
      idempotencyKey: options.idempotencyKey,
    });
    return await this[WRITE](request, proto.leaseState, { timeoutMs: options.timeoutMs });
  }

  /** Reads a lease. */
  async readLease(resource: string): Promise<LeaseState> {
    return await this.#send(proto.readLease(resource), proto.leaseState);
  }

  /**
   * A {@link Lease} on `resource`: one term, acquired with {@link Lease.acquire}, renewed
   * in the background, ended on the holder's own clock before it can pass.
   */
  lease(resource: string, options: LeaseOptions & { holder?: string | undefined } = {}): Lease {
    return new Lease(this, resource, this.#holder(options.holder), options);
  }

  /**
   * Whether the gateway and its backend are ready: `GET /readyz` answers `200`.
   *
   * `false` when it answers anything else (`503` while its database is down or refuses
   * writes) and when no answer comes: the gateway is stopped, paused or out of reach, or
   * `timeoutMs` passes (default: the gateway's `timeoutMs`). Throws only for a request
   * that cannot be sent at all, a mistake in the code.
   */
  async ready(options: { timeoutMs?: number | undefined } = {}): Promise<boolean> {
    try {
      return await this.#send({ method: 'GET', path: '/readyz', headers: {}, context: {} }, proto.ready, options.timeoutMs);
    } catch (error) {
      if (error instanceof GatewayUnreachable) return false;
      throw error;
    }
  }

  #holder(holder: string | undefined): string {
    const chosen = holder ?? this.holder;
    if (chosen === undefined) throw new TypeError('a lease needs a holder: pass { holder }, or new Gateway(url, { holder })');
    return chosen;
  }
}
