/**
 * fencegate for Node: fenced writes, hosted leases and fenced transactions.
 *
 * A writer that holds a lease presents its fencing token with every write; the gateway,
 * or Postgres itself for fenced tables, refuses a token older than the newest one it has
 * accepted for the resource. This package is the writer's side:
 *
 * - {@link Gateway}: the HTTP API (objects, fences, hosted leases step by step,
 *   `/v1/sql`, transactions over several resources with {@link Gateway.txn}), with
 *   bearer keys and TLS. Every write carries an `Idempotency-Key` and is resent with it,
 *   as the {@link RetryPolicy} says, when it got no decision.
 * - {@link Lease}: one term of a hosted lease, renewed in the background, ended on the
 *   holder's own clock before the lease can pass, with an `AbortSignal` that aborts at
 *   once when the gateway says the term is over.
 * - {@link fencedTransaction}: a node-postgres transaction that presents the token
 *   first, through the gateway's Postgres door or straight to Postgres.
 * - {@link addFencingToken}: an `@aws-sdk/client-s3` client whose writes carry the
 *   token in the `Fencing-Token` header, for the gateway's S3 door.
 * - One error class per stable error code.
 *
 * @packageDocumentation
 */

export * from './errors.js';
export { fenceError, fenceErrorFromSqlstate, fencedTransaction, SQLSTATE_STALE, SQLSTATE_TOKEN_NOT_ISSUED } from './fenced.js';
export type { Queryable } from './fenced.js';
export { DEFAULT_TIMEOUT_MS, DEFAULT_URL, Gateway } from './gateway.js';
export type { GatewayOptions, LeaseStepOptions } from './gateway.js';
export { jsonReplacer } from './json.js';
export type { Json, Jsonable } from './json.js';
export { Lease, leaseTiming } from './lease.js';
export type { LeaseOptions, LeaseTiming, LostReason } from './lease.js';
export { MAX_TOKEN, checkToken } from './protocol.js';
export type {
  FenceState,
  IfMatch,
  LeaseState,
  ObjectWriteOptions,
  PutOptions,
  SqlOutcome,
  SqlResult,
  Statement,
  StatementLike,
  StoredObject,
  TokenLike,
  TxnOperation,
  TxnOutcome,
  TxnResult,
  WriteOptions,
  WriteResult,
} from './protocol.js';
export {
  DEFAULT_RETRY,
  MAX_IDEMPOTENCY_KEY_LENGTH,
  NO_RETRY,
  checkIdempotencyKey,
  newIdempotencyKey,
  retryPolicy,
} from './retry.js';
export type { RetryPolicy } from './retry.js';
export {
  FENCING_TOKEN_HEADER,
  FENCING_TOKEN_MIDDLEWARE,
  S3_WRITE_OPERATIONS,
  addFencingToken,
  fencingTokenMiddleware,
} from './s3.js';
export type { FencingTokenMiddleware, MiddlewareStackHolder, TokenSource } from './s3.js';
export type { TlsFiles } from './transport.js';
export { VERSION } from './version.js';
