/**
 * The errors of fencegate, one class per stable error code.
 *
 * Every error this package throws is a {@link FencegateError}. An error answer of the
 * gateway is thrown as the class of its `error` code (`409 stale_token` as
 * {@link StaleToken}, `503 overloaded` as {@link Overloaded}, ...), and the fence inside
 * Postgres throws the same classes from its SQLSTATEs (`ZF001` as {@link StaleToken},
 * `ZF005` as {@link TokenNotIssued}), so a writer handles a stale term the same way
 * whichever door it wrote through.
 *
 * Two groups decide what to do next:
 *
 * - {@link FenceError}: the fence refused the token. A {@link StaleToken} means the
 *   writer's term is over: stop its work, never retry it with the same token, and do
 *   not fetch a newer token to push the old work through.
 * - {@link TransientError}: nothing was decided now; retry later, with the same
 *   `Idempotency-Key`. `writeApplied` says whether a write may have been applied
 *   (`false`: certainly not; `null`: unknown). The gateway client has already resent the
 *   write as its {@link RetryPolicy} says before throwing one.
 *
 * @module
 */

import { type Json, toJson } from './json.js';

/** The JSON fields of an error answer, or of a Postgres fence error made to look alike. */
export type ErrorBody = Readonly<Record<string, unknown>>;

/** What an error is made from. */
export interface ErrorInit {
  /** The HTTP status of the gateway's answer; absent without an answer, or from Postgres. */
  status?: number;
  /** The answer's fields: `error`, `message` and the code's extra fields. */
  body?: ErrorBody;
  /** The Postgres SQLSTATE behind the error, if any. */
  sqlstate?: string;
  /** The error this one was made from (a driver's, a socket's). */
  cause?: unknown;
  /** Transient errors: whether a write may have been applied (`null`: unknown). */
  writeApplied?: boolean | null;
  /** Transient errors: seconds the gateway asked to wait (`Retry-After`). */
  retryAfter?: number;
}

/** Base class of every error thrown by this package. */
export class FencegateError extends Error {
  /** The stable `error` code of the class; `undefined` for groups and local errors. */
  static readonly code: string | undefined = undefined;

  /** The stable `error` code of this error (a newer gateway's code for an unknown one). */
  readonly code: string | undefined;
  /** The HTTP status of the gateway's answer, if there was one. */
  readonly status: number | undefined;
  /** The answer's JSON fields (also for errors made from Postgres errors). */
  readonly body: ErrorBody;
  /** The Postgres SQLSTATE behind the error, if any. */
  readonly sqlstate: string | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = new.target.name;
    this.status = init.status;
    this.body = init.body ?? {};
    const code = (new.target as typeof FencegateError).code ?? this.body['error'];
    this.code = typeof code === 'string' ? code : undefined;
    const sqlstate = init.sqlstate ?? this.body['sqlstate'];
    this.sqlstate = typeof sqlstate === 'string' ? sqlstate : undefined;
  }

  /**
   * What `JSON.stringify(error)` writes: the name, the message and every field, with
   * tokens (bigint, which `JSON.stringify` refuses) as decimal strings.
   */
  toJSON(): { [key: string]: Json } {
    return toJson({ ...this, name: this.name, message: this.message }) as { [key: string]: Json };
  }
}

/**
 * The fence refused the token, over HTTP or inside Postgres (SQLSTATE class `ZF`).
 *
 * Thrown as itself for the ZF codes without a class of their own (`ZF002` no token,
 * `ZF003` not a token, `ZF004` not a resource name, and any newer one).
 */
export class FenceError extends FencegateError {
  /** The `key=value` pairs of the Postgres DETAIL (empty over HTTP). */
  get detail(): Record<string, string> {
    const raw = this.body['detail'];
    return typeof raw === 'string' ? parseFenceDetail(raw) : {};
  }
}

/** Nothing was decided now; the same request may succeed later. */
export class TransientError extends FencegateError {
  /**
   * For a write: `false` if it was certainly not applied, `null` if it may have been
   * (the connection or the database went away after the request was sent, by this
   * attempt or an earlier one).
   */
  writeApplied: boolean | null;
  /** Seconds the gateway asked to wait before retrying, if it did. */
  readonly retryAfter: number | undefined;
  /** How many times the write was sent, all with the same `Idempotency-Key`. */
  attempts = 1;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    this.writeApplied = init.writeApplied === undefined ? false : init.writeApplied;
    this.retryAfter = init.retryAfter;
  }
}

/**
 * The gateway did not answer: connection refused or reset, a timeout, or an answer that
 * is not the gateway's (a proxy's `502`). `writeApplied` is `false` when the request
 * never left, `null` when it may have reached the gateway.
 */
export class GatewayUnreachable extends TransientError {}

// ---------------------------------------------------------------- the fence

/** A resource whose fence is above the token a write presented for it. */
export interface StaleResource {
  readonly resource: string;
  readonly presented: bigint;
  readonly highest: bigint;
}

/**
 * `409 stale_token` / SQLSTATE `ZF001`: the token is below the resource's highest
 * accepted token. The writer's term is over: stop its work, do not retry it.
 */
export class StaleToken extends FenceError {
  static override readonly code = 'stale_token';
  /** The fenced resource (of a transaction: the first stale one). */
  readonly resource: string;
  /** The token the writer presented. */
  readonly presented: bigint;
  /** The resource's highest accepted token. */
  readonly highest: bigint;
  /**
   * Every stale resource: one for a single write, each one a refused transaction
   * ({@link Gateway.txn}) found stale, in the gateway's lock order.
   */
  readonly stale: readonly StaleResource[];

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    this.resource = str(this.body, 'resource') ?? '';
    this.presented = token(this.body, 'presented') ?? 0n;
    // The contract always sends `highest`; a stale token means highest > presented, so
    // presented + 1 is a true lower bound should something in between strip it.
    this.highest = token(this.body, 'highest') ?? this.presented + 1n;
    const listed = this.body['stale'];
    const stale = (Array.isArray(listed) ? (listed as unknown[]) : [])
      .filter((item): item is ErrorBody => typeof item === 'object' && item !== null)
      .map((item) => ({
        resource: str(item, 'resource') ?? '',
        presented: token(item, 'presented') ?? 0n,
        highest: token(item, 'highest') ?? 0n,
      }));
    this.stale = stale.length > 0 ? stale : [{ resource: this.resource, presented: this.presented, highest: this.highest }];
  }
}

/**
 * `403 token_not_issued` / SQLSTATE `ZF005`: the resource is bound to an issuer that
 * never issued this token; the fence did not move.
 */
export class TokenNotIssued extends FenceError {
  static override readonly code = 'token_not_issued';
  readonly resource: string;
  readonly presented: bigint;
  /** The latest token the issuer issued, `undefined` if it issued none. */
  readonly issued: bigint | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    this.resource = str(this.body, 'resource') ?? '';
    this.presented = token(this.body, 'presented') ?? 0n;
    this.issued = token(this.body, 'issued');
  }
}

/** `403 token_holder_mismatch`: the issuer's latest token, presented by another identity. */
export class TokenHolderMismatch extends FenceError {
  static override readonly code = 'token_holder_mismatch';
}

// ---------------------------------------------------------------- transient

/**
 * `503 backend_unavailable`: the database is unreachable or timed out. `writeApplied` is
 * the gateway's: `false` (certainly not applied) or `null` (it went away after receiving it).
 */
export class BackendUnavailable extends TransientError {
  static override readonly code = 'backend_unavailable';

  constructor(message: string, init: ErrorInit = {}) {
    const said = init.body?.['write_applied'];
    super(message, { ...init, writeApplied: init.writeApplied ?? (said === false ? false : null) });
  }
}

/** `503 overloaded`: nothing was applied; retry after `retryAfter` seconds. */
export class Overloaded extends TransientError {
  static override readonly code = 'overloaded';
}

/** `503 shutting_down`: the gateway began shutting down; nothing was applied. */
export class ShuttingDown extends TransientError {
  static override readonly code = 'shutting_down';
}

/**
 * `503 not_synchronously_replicated`: the gateway requires a synchronous standby of its
 * database (`--require-synchronous-replication`) and has none streaming; nothing was
 * applied. Retry after `retryAfter` seconds.
 */
export class NotSynchronouslyReplicated extends TransientError {
  static override readonly code = 'not_synchronously_replicated';
}

/**
 * `503 issuer_unavailable`: the token is above every token the gateway knows the
 * resource's issuer (etcd or ZooKeeper) issued, and the issuer
 * cannot be asked now; nothing was applied. Tokens it already vouched for keep working.
 * Retry after `retryAfter` seconds.
 */
export class IssuerUnavailable extends TransientError {
  static override readonly code = 'issuer_unavailable';
}

/** `408 body_timeout`: the body did not arrive in time; nothing was applied. */
export class BodyTimeout extends TransientError {
  static override readonly code = 'body_timeout';
}

/**
 * `409 idempotency_in_flight`: an earlier attempt with the same `Idempotency-Key` is
 * still running (Postgres). This attempt applied nothing; the earlier one may still
 * apply (`writeApplied` is `null`). Retry with the same key to get its answer.
 */
export class IdempotencyInFlight extends TransientError {
  static override readonly code = 'idempotency_in_flight';

  constructor(message: string, init: ErrorInit = {}) {
    super(message, { ...init, writeApplied: init.writeApplied === undefined ? null : init.writeApplied });
  }
}

// ---------------------------------------------------------------- leases

/** `409 lease_held`: another holder holds the lease. */
export class LeaseHeld extends FencegateError {
  static override readonly code = 'lease_held';
  /** Who holds it. */
  readonly holder: string | undefined;
  /** How long it still holds, on the gateway's clock. */
  readonly expiresInMs: number | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    this.holder = str(this.body, 'holder');
    const expires = this.body['expires_in_ms'];
    this.expiresInMs = typeof expires === 'number' ? expires : undefined;
  }
}

/**
 * `409 lease_lost`: this holder no longer holds the lease at that token; the term is
 * over. Also thrown by a {@link Lease} asked to act after its term ended (no `status`),
 * and the `reason` of its aborted signal.
 */
export class LeaseLost extends FencegateError {
  static override readonly code = 'lease_lost';
}

/** `409 tokens_exhausted`: the fence is at the largest token; reset it. */
export class TokensExhausted extends FencegateError {
  static override readonly code = 'tokens_exhausted';
}

/** `409 reset_refused`: a reset that does not lower the fence, or goes too low. */
export class ResetRefused extends FencegateError {
  static override readonly code = 'reset_refused';
}

// ---------------------------------------------------------------- requests

/**
 * `412 version_mismatch`: `If-Match` / `If-None-Match` did not hold, or a transaction's
 * `ifMatch` or `check` did not; nothing was applied.
 */
export class VersionMismatch extends FencegateError {
  static override readonly code = 'version_mismatch';
  /** The object's current version, `null` if it does not exist. */
  readonly current: number | null;
  /**
   * Of a transaction: the index, from 0, of the first operation whose precondition
   * failed; `undefined` for a single write.
   */
  readonly operation: number | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    const current = this.body['current'];
    this.current = typeof current === 'number' ? current : null;
    this.operation = int(this.body, 'operation');
  }
}

/** `428 missing_token`: a write without `Fencing-Token`. */
export class MissingToken extends FencegateError {
  static override readonly code = 'missing_token';
}

/** `400 invalid_token`: not a decimal, zero, negative, out of range, or twice. */
export class InvalidToken extends FencegateError {
  static override readonly code = 'invalid_token';
}

/** `400 invalid_holder`: `Fencing-Holder` too long, not UTF-8, or with control characters. */
export class InvalidHolder extends FencegateError {
  static override readonly code = 'invalid_holder';
}

/** `400 invalid_precondition`: weak or listed entity tags, or both preconditions. */
export class InvalidPrecondition extends FencegateError {
  static override readonly code = 'invalid_precondition';
}

/** `400 invalid_resource`: not 1-200 bytes of `[A-Za-z0-9._-]`, or only dots. */
export class InvalidResource extends FencegateError {
  static override readonly code = 'invalid_resource';
}

/** `400 invalid_key`: not 1-1024 bytes of UTF-8 without control characters. */
export class InvalidKey extends FencegateError {
  static override readonly code = 'invalid_key';
}

/** `400 invalid_body`: the body could not be read. */
export class InvalidBody extends FencegateError {
  static override readonly code = 'invalid_body';
}

/** `413 body_too_large`: the body is over the gateway's `--max-body`. */
export class BodyTooLarge extends FencegateError {
  static override readonly code = 'body_too_large';
}

/** `404 not_found`: no such object or path. */
export class NotFound extends FencegateError {
  static override readonly code = 'not_found';
}

/** `405 method_not_allowed`: the path exists, the method does not. */
export class MethodNotAllowed extends FencegateError {
  static override readonly code = 'method_not_allowed';
}

/** `401 unauthenticated`: no known key or client certificate. */
export class Unauthenticated extends FencegateError {
  static override readonly code = 'unauthenticated';
}

/** `403 forbidden`: the identity has no grant for the action on the resource. */
export class Forbidden extends FencegateError {
  static override readonly code = 'forbidden';
}

/**
 * `400 invalid_idempotency_key`: `Idempotency-Key` empty, over 255 bytes, not printable
 * ASCII, sent twice, or sent to a fence reset.
 */
export class InvalidIdempotencyKey extends FencegateError {
  static override readonly code = 'invalid_idempotency_key';
}

/**
 * `422 idempotency_key_reused`: the key was used before (by this identity) for another
 * request: another method, path, token, precondition or body. Nothing was applied. A
 * key names one logical write; never use it for a second one.
 */
export class IdempotencyKeyReused extends FencegateError {
  static override readonly code = 'idempotency_key_reused';
}

/**
 * `429 idempotency_quota_exceeded`: a new key while the answers stored under this
 * identity's keys, or all identities', are at the gateway's bound. Nothing was applied.
 * Stored answers expire after the gateway's `--idempotency-ttl`; a retry of a key
 * already stored is answered as ever.
 */
export class IdempotencyQuotaExceeded extends FencegateError {
  static override readonly code = 'idempotency_quota_exceeded';
}

/** `500 internal`: a bug in the gateway; details are in its log. */
export class Internal extends FencegateError {
  static override readonly code = 'internal';
}

// ---------------------------------------------------------------- /v1/sql

/** `400 sql_error`: a statement of the writer failed; nothing was committed. */
export class SqlError extends FencegateError {
  static override readonly code = 'sql_error';
  /** Index of the failed statement. */
  readonly statement: number | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    const statement = this.body['statement'];
    this.statement = typeof statement === 'number' ? statement : undefined;
  }
}

/** `400 invalid_param`: a parameter does not fit its type. */
export class InvalidParam extends FencegateError {
  static override readonly code = 'invalid_param';
}

/** `400 statement_not_allowed`: a statement refused before anything ran. */
export class StatementNotAllowed extends FencegateError {
  static override readonly code = 'statement_not_allowed';
}

/** `400 unsupported_type`: a parameter or column type `/v1/sql` cannot carry. */
export class UnsupportedType extends FencegateError {
  static override readonly code = 'unsupported_type';
}

/** `400 too_many_statements`: more statements than `--sql-max-statements`. */
export class TooManyStatements extends FencegateError {
  static override readonly code = 'too_many_statements';
}

/** `403 sql_disabled`: the gateway was started without `--sql`. */
export class SqlDisabled extends FencegateError {
  static override readonly code = 'sql_disabled';
}

/** `501 not_supported_by_backend`: `/v1/sql` on the embedded store. */
export class NotSupportedByBackend extends FencegateError {
  static override readonly code = 'not_supported_by_backend';
}

// ---------------------------------------------------------------- /v1/txn

/**
 * `400 invalid_transaction`: not a transaction: no operations, a resource with two
 * tokens, an object twice, ...
 */
export class InvalidTransaction extends FencegateError {
  static override readonly code = 'invalid_transaction';
  /** Index, from 0, of the operation at fault, if one is. */
  readonly operation: number | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    this.operation = int(this.body, 'operation');
  }
}

/** `400 too_many_operations`: more operations than `--txn-max-operations`. */
export class TooManyOperations extends FencegateError {
  static override readonly code = 'too_many_operations';
  /** The gateway's limit. */
  readonly limit: number | undefined;

  constructor(message: string, init: ErrorInit = {}) {
    super(message, init);
    this.limit = int(this.body, 'operation');
  }
}

// ---------------------------------------------------------------- lookup

/** A class of this module, as a constructor. */
export type ErrorClass = (new (message: string, init?: ErrorInit) => FencegateError) & { readonly code: string | undefined };

const CODED: readonly ErrorClass[] = [
  StaleToken,
  TokenNotIssued,
  TokenHolderMismatch,
  BackendUnavailable,
  Overloaded,
  ShuttingDown,
  NotSynchronouslyReplicated,
  IssuerUnavailable,
  BodyTimeout,
  IdempotencyInFlight,
  LeaseHeld,
  LeaseLost,
  TokensExhausted,
  ResetRefused,
  VersionMismatch,
  MissingToken,
  InvalidToken,
  InvalidHolder,
  InvalidPrecondition,
  InvalidResource,
  InvalidKey,
  InvalidBody,
  BodyTooLarge,
  NotFound,
  MethodNotAllowed,
  Unauthenticated,
  Forbidden,
  InvalidIdempotencyKey,
  IdempotencyKeyReused,
  IdempotencyQuotaExceeded,
  Internal,
  SqlError,
  InvalidParam,
  StatementNotAllowed,
  UnsupportedType,
  TooManyStatements,
  SqlDisabled,
  NotSupportedByBackend,
  InvalidTransaction,
  TooManyOperations,
];

/** Every stable error code of the gateway and its class. */
export const ERROR_CLASSES: ReadonlyMap<string, ErrorClass> = new Map(
  CODED.map((cls) => [cls.code as string, cls] as const),
);

/** The class of an `error` code; {@link FencegateError} for a code this version does not know. */
export function errorForCode(code: string): ErrorClass {
  return ERROR_CLASSES.get(code) ?? FencegateError;
}

/**
 * The `key=value` pairs of a fence error's DETAIL.
 *
 * @example parseFenceDetail('resource=sweeper presented=1 highest=2')
 * // { resource: 'sweeper', presented: '1', highest: '2' }
 */
export function parseFenceDetail(detail: string): Record<string, string> {
  const pairs: Record<string, string> = {};
  for (const item of detail.split(/\s+/)) {
    const at = item.indexOf('=');
    if (at > 0) pairs[item.slice(0, at)] = item.slice(at + 1);
  }
  return pairs;
}

function str(body: ErrorBody, name: string): string | undefined {
  const value = body[name];
  return typeof value === 'string' ? value : undefined;
}

function int(body: ErrorBody, name: string): number | undefined {
  const value = body[name];
  return typeof value === 'number' && Number.isSafeInteger(value) ? value : undefined;
}

/** A token field: bigint (as parsed from the answer), a safe integer, or decimal text. */
function token(body: ErrorBody, name: string): bigint | undefined {
  const value = body[name];
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number' && Number.isSafeInteger(value)) return BigInt(value);
  if (typeof value === 'string' && /^\d+$/.test(value)) return BigInt(value);
  return undefined;
}
