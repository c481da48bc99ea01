/**
 * JSON for what this package returns.
 *
 * Tokens are `bigint` (they go up to 2^63 - 1, past what a number holds exactly), and
 * `JSON.stringify` refuses a bigint ("Do not know how to serialize a BigInt"). So every
 * result and every error carries a `toJSON` that writes bigints as decimal strings, exact
 * at any size, and bytes (an object's value) as base64:
 *
 * ```ts
 * JSON.stringify(await gateway.put('orders', 'o-1', 'v', { token: 2n ** 60n }));
 * // {"resource":"orders","key":"o-1","token":"1152921504606846976","version":1,"created":true,"replayed":false}
 * ```
 *
 * `toJSON` is not enumerable: spreading a result (`{ ...result }`) leaves it behind. For
 * such copies, and for values of your own that hold tokens, pass {@link jsonReplacer}:
 * `JSON.stringify({ ...result, at }, jsonReplacer)`.
 *
 * @module
 */

/** A value `JSON.stringify` can write as it is. */
export type Json = string | number | boolean | null | Json[] | { [key: string]: Json };

/** Something with a `toJSON` that writes its bigints as decimal strings. */
export interface Jsonable {
  toJSON(): { [key: string]: Json };
}

/**
 * `value` with every bigint as a decimal string and every byte array as base64; functions
 * and `undefined` members are left out, as `JSON.stringify` does.
 */
export function toJson(value: unknown): Json {
  if (typeof value === 'bigint') return value.toString();
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength).toString('base64');
  if (value === null || typeof value !== 'object') {
    return typeof value === 'string' || typeof value === 'number' || typeof value === 'boolean' ? value : null;
  }
  if (Array.isArray(value)) return value.map(toJson);
  const out: { [key: string]: Json } = {};
  for (const [key, item] of Object.entries(value)) {
    if (item === undefined || typeof item === 'function' || typeof item === 'symbol') continue;
    out[key] = toJson(item);
  }
  return out;
}

/**
 * A replacer for `JSON.stringify(value, jsonReplacer)`: bigints as decimal strings.
 * (Bytes are written by their own `toJSON` before a replacer sees them: a `Buffer` as
 * `{"type":"Buffer","data":[...]}`.)
 */
export function jsonReplacer(_key: string, value: unknown): unknown {
  return typeof value === 'bigint' ? value.toString() : value;
}

/** `result` with a `toJSON` (not enumerable) that writes it with {@link toJson}. */
export function withJson<T extends object>(result: T): T & Jsonable {
  Object.defineProperty(result, 'toJSON', {
    value(this: object) {
      return toJson(this) as { [key: string]: Json };
    },
    enumerable: false,
    writable: true,
    configurable: true,
  });
  return result as T & Jsonable;
}
