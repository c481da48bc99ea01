/**
 * Fenced transactions with node-postgres, through the gateway's Postgres door or
 * straight to Postgres, on tables protected with `fencegate protect`.
 *
 * | SQLSTATE | thrown as | DETAIL |
 * |---|---|---|
 * | `ZF001` | {@link StaleToken} | `resource=<r> presented=<n> highest=<n>` |
 * | `ZF005` | {@link TokenNotIssued} | `resource=<r> presented=<n> issued=<n>` |
 * | `ZF...` | {@link FenceError} | (`ZF002` no token, `ZF003` not a token, ...) |
 *
 * The driver's error is kept as `cause`. Nothing of a refused transaction was applied:
 * Postgres rolled it back.
 *
 * @module
 */

import { FenceError, FencegateError, StaleToken, TokenNotIssued, parseFenceDetail } from './errors.js';
import { type TokenLike, checkToken } from './protocol.js';

/** The fence's SQLSTATE for a stale token. */
export const SQLSTATE_STALE = 'ZF001';

/** The fence's SQLSTATE for a token its resource's issuer never issued. */
export const SQLSTATE_TOKEN_NOT_ISSUED = 'ZF005';

/**
 * What `fencedTransaction` needs of a connection: node-postgres's `Client` and a
 * pool's `PoolClient` have it. (Not a `Pool`: its queries may each take another
 * connection, and a transaction needs one.)
 */
export interface Queryable {
  query(text: string, values?: unknown[]): Promise<{ command?: string | null }>;
}

// The casts pin the function's signature; the token goes as text, exact for any bigint.
const FENCE = 'SELECT fencegate.fence($1::text, $2::bigint)';

/**
 * Runs `work` in a transaction that presents `token` for `resource` before anything else.
 *
 * `BEGIN`, then `SELECT fencegate.fence(resource, token)` (a stale token fails here,
 * before any write), then `work(client)`, then `COMMIT`; `ROLLBACK` if anything throws.
 *
 * @example
 * ```ts
 * const client = await pool.connect();
 * try {
 *   await fencedTransaction(client, 'sweeper', lease.token, (tx) =>
 *     tx.query('UPDATE sweep_state SET note = $1 WHERE id = 1', ['sweep by node-b']));
 * } finally {
 *   client.release();
 * }
 * ```
 *
 * @returns what `work` returned, once committed.
 * @throws {@link StaleToken} `ZF001`: a newer term raised the fence. Stop this term's
 *   work and do not retry it with the same token.
 * @throws {@link TokenNotIssued} `ZF005`: the resource's issuer never issued the token.
 * @throws {@link FenceError} any other fence SQLSTATE (class `ZF`).
 */
export async function fencedTransaction<C extends Queryable, T>(
  client: C,
  resource: string,
  token: TokenLike,
  work: (client: C) => Promise<T>,
): Promise<T> {
  const value = checkToken(token);
  await client.query('BEGIN');
  try {
    await client.query(FENCE, [resource, value.toString()]);
    const result = await work(client);
    const commit = await client.query('COMMIT');
    // A transaction that failed inside `work` (its error caught there) "commits" as a
    // rollback: say so rather than report it applied.
    if (commit.command === 'ROLLBACK') {
      throw new FencegateError('the transaction had failed and was rolled back at COMMIT');
    }
    return result;
  } catch (error) {
    await client.query('ROLLBACK').catch(() => undefined); // the connection may be gone
    throw fenceError(error) ?? error;
  }
}

/**
 * The fence error behind a driver's error, or `undefined` if it is not one. Follows
 * `cause` (an ORM's wrapper) down to node-postgres's `DatabaseError`.
 */
export function fenceError(error: unknown): FenceError | undefined {
  const seen = new Set<unknown>();
  let current: unknown = error;
  while (typeof current === 'object' && current !== null && !seen.has(current)) {
    seen.add(current);
    if (current instanceof FencegateError) return undefined; // already ours
    const { code, detail, message } = current as { code?: unknown; detail?: unknown; message?: unknown };
    if (typeof code === 'string' && /^ZF[0-9A-Z]{3}$/.test(code)) {
      return fenceErrorFromSqlstate(
        code,
        typeof message === 'string' ? message : code,
        typeof detail === 'string' ? detail : undefined,
        current,
      );
    }
    current = (current as { cause?: unknown }).cause;
  }
  return undefined;
}

/** The error of a fence SQLSTATE, given its message and DETAIL. */
export function fenceErrorFromSqlstate(sqlstate: string, message: string, detail?: string, cause?: unknown): FenceError {
  const body: Record<string, unknown> = { message };
  if (detail !== undefined) {
    body['detail'] = detail;
    for (const [key, value] of Object.entries(parseFenceDetail(detail))) {
      body[key] = ['presented', 'highest', 'issued'].includes(key) && /^\d+$/.test(value) ? BigInt(value) : value;
    }
  }
  if (sqlstate === SQLSTATE_STALE) {
    return new StaleToken(message, { body: { error: StaleToken.code, ...body }, sqlstate, cause });
  }
  if (sqlstate === SQLSTATE_TOKEN_NOT_ISSUED) {
    return new TokenNotIssued(message, { body: { error: TokenNotIssued.code, ...body }, sqlstate, cause });
  }
  return new FenceError(message, { body, sqlstate, cause });
}
