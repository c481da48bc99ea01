/**
 * The HTTP API without I/O: the requests to send and what to make of the answers.
 *
 * @module
 */

import { type ErrorBody, FencegateError, GatewayUnreachable, TransientError, errorForCode } from './errors.js';
import { type Jsonable, withJson } from './json.js';
import { keyFor } from './retry.js';

/** The largest fencing token: tokens are 1 to 2^63 - 1. */
export const MAX_TOKEN = 2n ** 63n - 1n;

/** A fencing token as the caller may give it. Results always carry `bigint`. */
export type TokenLike = bigint | number;

/** `If-Match`: a version (`0`: the object must not exist), or `'*'` (it must exist). */
export type IfMatch = number | '*';

/** Checks a token and returns it as a `bigint`. */
export function checkToken(token: TokenLike): bigint {
  let value: bigint;
  if (typeof token === 'bigint') value = token;
  else if (typeof token === 'number' && Number.isSafeInteger(token)) value = BigInt(token);
  else if (typeof token === 'number' && Number.isInteger(token)) {
    // Above 2^53 a number has already lost digits: the token it stood for is unknown.
    throw new TypeError(
      `a fencing token above 2^53 must be passed as a bigint, e.g. 2n ** 60n or BigInt("1152921504606846976"): ` +
        `the number ${String(token)} is not exact`,
    );
  } else if (typeof token === 'number') throw new TypeError(`a fencing token is an integer, not ${String(token)}`);
  else throw new TypeError(`a fencing token is a bigint or an integer number, not ${typeof token} ${String(token)}`);
  if (value < 1n || value > MAX_TOKEN) throw new RangeError(`a fencing token is 1 to ${MAX_TOKEN}, not ${value}`);
  return value;
}

/** A lease's time to live, checked against what the gateway accepts. */
export function checkTtl(ttlMs: number): number {
  if (!Number.isInteger(ttlMs) || ttlMs < 10 || ttlMs > 86_400_000) {
    throw new RangeError(`a lease's ttlMs is an integer from 10 to 86400000, not ${ttlMs}`);
  }
  return ttlMs;
}

/** A request to send, and the fields its errors should name. */
export interface Request {
  readonly method: 'GET' | 'PUT' | 'DELETE' | 'POST';
  readonly path: string;
  readonly headers: Readonly<Record<string, string>>;
  readonly body?: Uint8Array;
  /** Fields the request already knows (`resource`, `presented`), merged into its errors. */
  readonly context: ErrorBody;
}

/** An answer as the transport read it. */
export interface Answer {
  readonly status: number;
  readonly headers: Readonly<Record<string, string | string[] | undefined>>;
  readonly body: Uint8Array;
}

/** The options every write takes. */
export interface WriteOptions {
  /** The fencing token of the writer's term. */
  token: TokenLike;
  /** `Fencing-Holder` for this write (default: the gateway's `holder`). */
  holder?: string | undefined;
  /**
   * The write's `Idempotency-Key` (default: a fresh random one). Pass your own to retry
   * the same logical write later, even from another process: the gateway applies it
   * once and answers every attempt with the first one's answer.
   */
  idempotencyKey?: string | undefined;
  /** Aborts the request, and its resends. */
  signal?: AbortSignal | undefined;
}

/** A `PUT` or `DELETE` with its preconditions. */
export interface ObjectWriteOptions extends WriteOptions {
  /** Compare-and-swap on the object's version (`0`: must not exist; `'*'`: must exist). */
  ifMatch?: IfMatch | undefined;
}

/** A `PUT`. */
export interface PutOptions extends ObjectWriteOptions {
  /** The object must not exist. */
  ifNoneMatch?: boolean | undefined;
}

/**
 * An accepted `PUT` or `DELETE`: committed, with the fence at least `token`.
 * `JSON.stringify` writes its token as a decimal string (see {@link Jsonable}).
 */
export interface WriteResult extends Jsonable {
  readonly resource: string;
  readonly key: string;
  readonly token: bigint;
  /** The object's version after the write; versions rise by one per write of a key. */
  readonly version: number;
  /** `true` when a `PUT` created the object (`201`). */
  readonly created: boolean;
  /**
   * `true` when the answer is the one stored for an earlier attempt with the same
   * `Idempotency-Key` (`Idempotency-Replayed: true`): the write was applied once, by
   * that attempt.
   */
  readonly replayed: boolean;
}

/** An object read with `GET`; `JSON.stringify` writes its value as base64. */
export interface StoredObject extends Jsonable {
  readonly value: Uint8Array;
  readonly version: number;
  /** The token of the write that stored this value. */
  readonly token: bigint;
  /** The value decoded as UTF-8. */
  text(): string;
}

/** A resource's fence. */
export interface FenceState extends Jsonable {
  readonly resource: string;
  /** The highest accepted token, `null` if nothing was ever accepted. */
  readonly highest: bigint | null;
  /** An advance's stored answer, replayed (see {@link WriteResult.replayed}). */
  readonly replayed: boolean;
}

/** A lease hosted by the gateway, as it stands after a request. */
export interface LeaseState extends Jsonable {
  readonly resource: string;
  readonly held: boolean;
  readonly holder: string | null;
  /** The authenticated identity the lease is bound to (with `--auth-file`). */
  readonly identity: string | null;
  readonly token: bigint | null;
  /** How long the lease still holds, on the gateway's clock (replayed: as first answered). */
  readonly expiresInMs: number;
  /** A lease step's stored answer, replayed (see {@link WriteResult.replayed}). */
  readonly replayed: boolean;
}

/** One statement of `/v1/sql`: SQL text with `$n` parameters. */
export interface Statement {
  readonly sql: string;
  readonly params?: readonly unknown[];
}

/** A statement, or SQL text without parameters. */
export type StatementLike = Statement | string;

/** The result of one statement. */
export interface SqlResult {
  readonly rowsAffected: number;
  readonly columns: readonly { readonly name: string; readonly type: string }[];
  readonly rows: readonly (readonly unknown[])[];
  /** Rows past the gateway's `--sql-max-rows` were left out. */
  readonly truncated: boolean;
}

/** A committed fenced SQL transaction. */
export interface SqlOutcome extends Jsonable {
  readonly resource: string;
  readonly token: bigint;
  readonly results: readonly SqlResult[];
  /** The stored answer of an earlier attempt, replayed (see {@link WriteResult.replayed}). */
  readonly replayed: boolean;
}

/**
 * One operation of {@link Gateway.txn}, with the token of the writer's term on its
 * resource (all operations on one resource the same):
 *
 * - `put`: writes the object (`value` text as such, bytes as base64);
 * - `delete`: deletes it;
 * - `advance`: raises the resource's fence to the token;
 * - `check`: requires, without writing, that the fence is not above the token and, with
 *   `key`, that the object is at `version` (`0`: it does not exist), until the commit.
 *
 * `ifMatch`: a version the object must be at (`0`: it must not exist), or `'*'` (it must
 * exist).
 */
export type TxnOperation =
  | {
      readonly op: 'put';
      readonly resource: string;
      readonly key: string;
      readonly value: string | Uint8Array;
      readonly token: TokenLike;
      readonly ifMatch?: IfMatch | undefined;
    }
  | {
      readonly op: 'delete';
      readonly resource: string;
      readonly key: string;
      readonly token: TokenLike;
      readonly ifMatch?: IfMatch | undefined;
    }
  | { readonly op: 'advance'; readonly resource: string; readonly token: TokenLike }
  | {
      readonly op: 'check';
      readonly resource: string;
      readonly token: TokenLike;
      readonly key?: string | undefined;
      readonly version?: number | undefined;
    };

/** What one operation of a committed transaction did. */
export type TxnResult = Jsonable &
  (
    | {
        readonly op: 'put';
        readonly resource: string;
        readonly token: bigint;
        readonly key: string;
        /** The object's version after the transaction. */
        readonly version: number;
        /** `true` when the put created the object. */
        readonly created: boolean;
      }
    | { readonly op: 'delete'; readonly resource: string; readonly token: bigint; readonly key: string; readonly version: number }
    | { readonly op: 'advance'; readonly resource: string; readonly token: bigint }
    | {
        readonly op: 'check';
        readonly resource: string;
        readonly token: bigint;
        /** With a key: the object, and the version it was found at. */
        readonly key?: string;
        readonly version?: number;
      }
  );

/** A committed transaction: one result per operation, in order. */
export interface TxnOutcome extends Jsonable {
  readonly results: readonly TxnResult[];
  /** The stored answer of an earlier attempt, replayed (see {@link WriteResult.replayed}). */
  readonly replayed: boolean;
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();
const JSON_TYPE = { 'content-type': 'application/json' };

function resourcePath(resource: string): string {
  return encodeURIComponent(resource);
}

function keyPath(key: string): string {
  // A key may contain "/", which the gateway keeps; the rest is percent-encoded.
  return key.split('/').map(encodeURIComponent).join('/');
}

function writeHeaders(
  options: WriteOptions & { ifMatch?: IfMatch | undefined; ifNoneMatch?: boolean | undefined },
  holder: string | undefined,
): Record<string, string> {
  // The key is made here, once per logical write: the request is what every attempt resends.
  const headers: Record<string, string> = {
    'fencing-token': checkToken(options.token).toString(),
    'idempotency-key': keyFor(options.idempotencyKey),
  };
  const who = options.holder ?? holder;
  if (who !== undefined) headers['fencing-holder'] = who;
  if (options.ifMatch !== undefined) {
    headers['if-match'] = options.ifMatch === '*' ? '*' : `"${options.ifMatch}"`;
  }
  if (options.ifNoneMatch) headers['if-none-match'] = '*';
  return headers;
}

function writeContext(resource: string, token: TokenLike): ErrorBody {
  return { resource, presented: checkToken(token) };
}

export function put(
  resource: string,
  key: string,
  value: string | Uint8Array,
  options: PutOptions,
  holder: string | undefined,
): Request {
  return {
    method: 'PUT',
    path: `/v1/kv/${resourcePath(resource)}/${keyPath(key)}`,
    headers: { ...writeHeaders(options, holder), 'content-type': 'application/octet-stream' },
    body: typeof value === 'string' ? encoder.encode(value) : value,
    context: writeContext(resource, options.token),
  };
}

export function del(resource: string, key: string, options: ObjectWriteOptions, holder: string | undefined): Request {
  return {
    method: 'DELETE',
    path: `/v1/kv/${resourcePath(resource)}/${keyPath(key)}`,
    headers: writeHeaders(options, holder),
    context: writeContext(resource, options.token),
  };
}

export function get(resource: string, key: string): Request {
  return { method: 'GET', path: `/v1/kv/${resourcePath(resource)}/${keyPath(key)}`, headers: {}, context: { resource } };
}

export function fence(resource: string): Request {
  return { method: 'GET', path: `/v1/fences/${resourcePath(resource)}`, headers: {}, context: { resource } };
}

export function advance(resource: string, options: WriteOptions, holder: string | undefined): Request {
  return {
    method: 'POST',
    path: `/v1/fences/${resourcePath(resource)}/advance`,
    headers: writeHeaders(options, holder),
    context: writeContext(resource, options.token),
  };
}

export function sql(
  resource: string,
  statements: readonly StatementLike[],
  options: WriteOptions,
  holder: string | undefined,
): Request {
  const body = {
    statements: statements.map((item) =>
      typeof item === 'string' ? { sql: item } : { sql: item.sql, params: item.params ?? [] },
    ),
  };
  return {
    method: 'POST',
    path: `/v1/sql/${resourcePath(resource)}`,
    headers: { ...writeHeaders(options, holder), ...JSON_TYPE },
    body: encoder.encode(JSON.stringify(body)),
    context: writeContext(resource, options.token),
  };
}

export function leaseStep(
  resource: string,
  step: 'acquire' | 'renew' | 'release',
  fields: { holder: string; token?: TokenLike; ttlMs?: number; idempotencyKey?: string | undefined },
): Request {
  // Written field by field: JSON.stringify cannot write a bigint as a number.
  const members = [`"holder":${JSON.stringify(fields.holder)}`];
  const context: Record<string, unknown> = { resource };
  if (fields.token !== undefined) {
    const token = checkToken(fields.token);
    members.push(`"token":${token}`);
    context['presented'] = token;
  }
  if (fields.ttlMs !== undefined) members.push(`"ttl_ms":${checkTtl(fields.ttlMs)}`);
  return {
    method: 'POST',
    path: `/v1/leases/${resourcePath(resource)}/${step}`,
    headers: { ...JSON_TYPE, 'idempotency-key': keyFor(fields.idempotencyKey) },
    body: encoder.encode(`{${members.join(',')}}`),
    context,
  };
}

export function readLease(resource: string): Request {
  return { method: 'GET', path: `/v1/leases/${resourcePath(resource)}`, headers: {}, context: { resource } };
}

function ifMatchMember(ifMatch: IfMatch | undefined): string[] {
  if (ifMatch === undefined) return [];
  if (ifMatch === '*') return ['"if_match":"*"'];
  if (!Number.isSafeInteger(ifMatch) || ifMatch < 0) throw new RangeError(`ifMatch is a version (0 or more) or '*', not ${ifMatch}`);
  return [`"if_match":${ifMatch}`];
}

/** One operation as JSON, written member by member: JSON.stringify cannot write a bigint as a number. */
function txnOperation(operation: TxnOperation): string {
  const text = JSON.stringify;
  const members = [
    `"op":${text(operation.op)}`,
    `"resource":${text(operation.resource)}`,
    `"token":${checkToken(operation.token)}`,
  ];
  switch (operation.op) {
    case 'put':
      members.push(`"key":${text(operation.key)}`);
      members.push(
        typeof operation.value === 'string'
          ? `"value":${text(operation.value)}`
          : `"value_base64":${text(Buffer.from(operation.value).toString('base64'))}`,
      );
      members.push(...ifMatchMember(operation.ifMatch));
      break;
    case 'delete':
      members.push(`"key":${text(operation.key)}`, ...ifMatchMember(operation.ifMatch));
      break;
    case 'advance':
      break;
    case 'check':
      if ((operation.key === undefined) !== (operation.version === undefined)) {
        throw new TypeError('a check of an object takes both key and version');
      }
      if (operation.key !== undefined) members.push(`"key":${text(operation.key)}`, `"version":${operation.version}`);
      break;
    default:
      throw new TypeError(`a transaction's operation is a put, delete, advance or check, not ${text(operation)}`);
  }
  return `{${members.join(',')}}`;
}

export function txn(operations: readonly TxnOperation[], idempotencyKey: string | undefined): Request {
  const body = `{"operations":[${operations.map(txnOperation).join(',')}]}`;
  return {
    method: 'POST',
    path: '/v1/txn',
    headers: { ...JSON_TYPE, 'idempotency-key': keyFor(idempotencyKey) },
    body: encoder.encode(body),
    context: {},
  };
}

// ---------------------------------------------------------------- answers

const TOKEN_FIELDS = /"(token|highest|presented|issued)"(\s*):(\s*)(\d+)/g;

/**
 * Parses a JSON answer with its token fields as `bigint`: tokens go up to 2^63 - 1, past
 * what a JSON number keeps exactly. (A quote inside a JSON string is always escaped, so
 * the pattern only meets real field names.)
 */
export function parseJson(body: Uint8Array): Record<string, unknown> {
  const text = decoder.decode(body).replace(TOKEN_FIELDS, '"$1"$2:$3"#$4"');
  const value: unknown = JSON.parse(text, (_key, item: unknown) =>
    typeof item === 'string' && /^#\d+$/.test(item) ? BigInt(item.slice(1)) : item,
  );
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new SyntaxError('an answer that is not a JSON object');
  }
  return value as Record<string, unknown>;
}

function header(answer: Answer, name: string): string | undefined {
  const value = answer.headers[name];
  return Array.isArray(value) ? value[0] : value;
}

function replayed(answer: Answer): boolean {
  return header(answer, 'idempotency-replayed')?.toLowerCase() === 'true';
}

function asBigint(value: unknown): bigint {
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number') return BigInt(value);
  throw new TypeError(`not a token: ${String(value)}`);
}

function check(answer: Answer, request: Request): void {
  if (answer.status >= 300) throw errorFromAnswer(answer, request);
}

export function writeResult(answer: Answer, request: Request): WriteResult {
  check(answer, request);
  const body = parseJson(answer.body);
  return withJson({
    resource: String(body['resource']),
    key: String(body['key']),
    token: asBigint(body['token']),
    version: Number(body['version']),
    created: answer.status === 201,
    replayed: replayed(answer),
  });
}

export function storedObject(answer: Answer, request: Request): StoredObject | null {
  if (answer.status === 404) return null;
  check(answer, request);
  const value = answer.body;
  return withJson({
    value,
    version: Number((header(answer, 'etag') ?? '"0"').replaceAll('"', '')),
    token: BigInt(header(answer, 'fencing-token') ?? '0'),
    text: () => decoder.decode(value),
  });
}

export function fenceState(answer: Answer, request: Request): FenceState {
  check(answer, request);
  const body = parseJson(answer.body);
  return withJson({
    resource: String(body['resource']),
    highest: body['highest'] == null ? null : asBigint(body['highest']),
    replayed: replayed(answer),
  });
}

export function leaseState(answer: Answer, request: Request): LeaseState {
  check(answer, request);
  const body = parseJson(answer.body);
  return withJson({
    resource: String(body['resource']),
    held: body['held'] === true,
    holder: typeof body['holder'] === 'string' ? body['holder'] : null,
    identity: typeof body['identity'] === 'string' ? body['identity'] : null,
    token: body['token'] == null ? null : asBigint(body['token']),
    expiresInMs: Number(body['expires_in_ms'] ?? 0),
    replayed: replayed(answer),
  });
}

export function sqlOutcome(answer: Answer, request: Request): SqlOutcome {
  check(answer, request);
  const body = parseJson(answer.body);
  const results = (body['results'] as Record<string, unknown>[]).map((result) => ({
    rowsAffected: Number(result['rows_affected']),
    columns: (result['columns'] as { name: string; type: string }[] | undefined) ?? [],
    rows: (result['rows'] as unknown[][] | undefined) ?? [],
    truncated: result['truncated'] === true,
  }));
  return withJson({ resource: String(body['resource']), token: asBigint(body['token']), results, replayed: replayed(answer) });
}

function txnResult(result: Record<string, unknown>): TxnResult {
  const resource = String(result['resource']);
  const token = asBigint(result['token']);
  const op = result['op'];
  switch (op) {
    case 'put':
      return withJson({
        op,
        resource,
        token,
        key: String(result['key']),
        version: Number(result['version']),
        created: result['created'] === true,
      });
    case 'delete':
      return withJson({ op, resource, token, key: String(result['key']), version: Number(result['version']) });
    case 'advance':
      return withJson({ op, resource, token });
    case 'check':
      return withJson(
        result['key'] === undefined
          ? { op, resource, token }
          : { op, resource, token, key: String(result['key']), version: Number(result['version']) },
      );
    default:
      throw new FencegateError(`a transaction result of an unknown operation: ${String(op)}`);
  }
}

export function txnOutcome(answer: Answer, request: Request): TxnOutcome {
  check(answer, request);
  const body = parseJson(answer.body);
  return withJson({ results: (body['results'] as Record<string, unknown>[]).map(txnResult), replayed: replayed(answer) });
}

export function ready(answer: Answer): boolean {
  return answer.status === 200;
}

function retryAfter(answer: Answer): number | undefined {
  const value = Number(header(answer, 'retry-after'));
  return Number.isFinite(value) ? value : undefined;
}

/** The error of an error answer: the class of its `error` code. */
export function errorFromAnswer(answer: Answer, request: Request): FencegateError {
  let body: Record<string, unknown> | undefined;
  try {
    body = parseJson(answer.body);
  } catch {
    body = undefined;
  }
  const status = answer.status;
  if (body === undefined || typeof body['error'] !== 'string') {
    if (status === 502 || status === 503 || status === 504) {
      // Not the gateway's answer: something in front of it, which may or may not have
      // passed the request on.
      return new GatewayUnreachable(`HTTP ${status} from something in front of the gateway`, {
        status,
        writeApplied: null,
        retryAfter: retryAfter(answer),
      });
    }
    return new FencegateError(`an answer that is not fencegate's: HTTP ${status}`, { status });
  }
  const merged: Record<string, unknown> = { ...request.context, ...body };
  const highest = header(answer, 'fencing-highest');
  if (merged['highest'] === undefined && highest !== undefined && /^\d+$/.test(highest)) {
    merged['highest'] = BigInt(highest);
  }
  const cls = errorForCode(body['error']);
  const message = typeof body['message'] === 'string' ? body['message'] : body['error'];
  if (cls.prototype instanceof TransientError) {
    return new cls(message, { status, body: merged, retryAfter: retryAfter(answer) });
  }
  return new cls(message, { status, body: merged });
}
