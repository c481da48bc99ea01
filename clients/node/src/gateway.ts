/**
 * The client of the gateway's HTTP API.
 *
 * @module
 */

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
  WriteOptions,
  WriteResult,
} from './protocol.js';
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
}

/**
 * A client of a fencegate gateway.
 *
 * Every write takes the fencing token of the writer's term, and every error answer is
 * thrown as the class of its code. Nothing is retried here: a stale write must never
 * be, and whether to retry a transient one is the writer's call (`writeApplied`).
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
  readonly #transport: Transport;

  constructor(url: string = DEFAULT_URL, options: GatewayOptions = {}) {
    const headers: Record<string, string> = { 'user-agent': `fencegate-node/${VERSION}` };
    if (options.key !== undefined) headers['authorization'] = `Bearer ${options.key}`;
    this.holder = options.holder;
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
   * Writes `value` as the object `resource/key` if the token is current.
   *
   * @throws {@link StaleToken} a newer term has written: stop this term's work.
   * @throws {@link VersionMismatch} the precondition did not hold.
   * @throws {@link TransientError} nothing decided; see `writeApplied`.
   */
  async put(resource: string, key: string, value: string | Uint8Array, options: PutOptions): Promise<WriteResult> {
    return await this.#send(proto.put(resource, key, value, options, this.holder), proto.writeResult, undefined, options.signal);
  }

  /** Deletes the object (a missing one is fine) if the token is current. */
  async delete(resource: string, key: string, options: ObjectWriteOptions): Promise<WriteResult> {
    return await this.#send(proto.del(resource, key, options, this.holder), proto.writeResult, undefined, options.signal);
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
    return await this.#send(proto.advance(resource, options, this.holder), proto.fenceState, undefined, options.signal);
  }

  /**
   * Runs the writer's statements after the fence check, in one transaction
   * (`POST /v1/sql`; Postgres backend with `--sql`).
   */
  async sql(resource: string, statements: readonly StatementLike[], options: WriteOptions): Promise<SqlOutcome> {
    return await this.#send(proto.sql(resource, statements, options, this.holder), proto.sqlOutcome, undefined, options.signal);
  }

  /**
   * Takes the lease if it is free, expired or already the holder's: always a new token,
   * with the resource's fence raised to it.
   *
   * @throws {@link LeaseHeld} another holder holds it.
   */
  async acquireLease(resource: string, options: { ttlMs: number; holder?: string | undefined }): Promise<LeaseState> {
    const request = proto.leaseStep(resource, 'acquire', { holder: this.#holder(options.holder), ttlMs: options.ttlMs });
    return await this.#send(request, proto.leaseState);
  }

  /**
   * Extends the lease held at `token`.
   *
   * @throws {@link LeaseLost} the term is over.
   */
  async renewLease(
    resource: string,
    options: { token: TokenLike; ttlMs: number; holder?: string | undefined; timeoutMs?: number | undefined },
  ): Promise<LeaseState> {
    const request = proto.leaseStep(resource, 'renew', {
      holder: this.#holder(options.holder),
      token: options.token,
      ttlMs: options.ttlMs,
    });
    return await this.#send(request, proto.leaseState, options.timeoutMs);
  }

  /** Gives the lease up, so that a rival may take it at once. */
  async releaseLease(
    resource: string,
    options: { token: TokenLike; holder?: string | undefined; timeoutMs?: number | undefined },
  ): Promise<LeaseState> {
    const request = proto.leaseStep(resource, 'release', { holder: this.#holder(options.holder), token: options.token });
    return await this.#send(request, proto.leaseState, options.timeoutMs);
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

  /** Whether the gateway and its backend answer (`GET /readyz`). */
  async ready(): Promise<boolean> {
    return await this.#send({ method: 'GET', path: '/readyz', headers: {}, context: {} }, proto.ready);
  }

  #holder(holder: string | undefined): string {
    const chosen = holder ?? this.holder;
    if (chosen === undefined) throw new TypeError('a lease needs a holder: pass { holder }, or new Gateway(url, { holder })');
    return chosen;
  }
}
