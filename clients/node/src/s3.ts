/**
 * Fencing tokens on `@aws-sdk/client-s3`'s writes, through the gateway's S3 door.
 *
 * The door takes a write's token from the object metadata `x-amz-meta-fencing-token`
 * or from the `Fencing-Token` header. Metadata exists only on the commands that create
 * an object; `DeleteObjectCommand` and the multipart commands have none, so
 * {@link addFencingToken} sends the header, on every write command of one client:
 *
 * ```ts
 * const s3 = new S3Client({ endpoint: 'http://127.0.0.1:7480', forcePathStyle: true, region: 'us-east-1' });
 * const remove = addFencingToken(s3, () => lease.check());
 * await s3.send(new PutObjectCommand({ Bucket: 'data', Key: 'orders/2026-12.json', Body: body }));
 * ```
 *
 * Behavior:
 *
 * - The middleware runs in the stack's `build` step, once per command, before the
 *   `finalizeRequest` step retries and signs: the header is one of the request's SigV4
 *   signed headers, and the SDK's own resends of that command carry the same token.
 * - The token source is read once per command. A function such as `() => lease.check()`
 *   throws once the term is over, so the command rejects before anything is sent.
 * - Reads (GetObject, HeadObject, listings) get no header, and presigned URLs are not
 *   touched.
 *
 * Nothing here imports the AWS SDK: the types below describe the shapes it uses, so
 * this package does not depend on it.
 *
 * @module
 */

import { type TokenLike, checkToken } from './protocol.js';

/** The S3 operations that present a token: the door's writes. */
export const S3_WRITE_OPERATIONS: ReadonlySet<string> = new Set([
  'PutObject',
  'CopyObject',
  'DeleteObject',
  'DeleteObjects',
  'CreateMultipartUpload',
  'UploadPart',
  'UploadPartCopy',
  'CompleteMultipartUpload',
  'AbortMultipartUpload',
]);

/** A fencing token, or a function that returns the current one (`() => lease.check()`). */
export type TokenSource = TokenLike | (() => TokenLike);

/** The header the door reads a token from when a write carries no metadata token. */
export const FENCING_TOKEN_HEADER = 'fencing-token';

/** The middleware's name in a stack. */
export const FENCING_TOKEN_MIDDLEWARE = 'fencingTokenMiddleware';

/**
 * A `build` step middleware of the AWS SDK for JavaScript v3 (its `BuildMiddleware`,
 * for any command's input and output).
 */
export type FencingTokenMiddleware = <Args extends { request: unknown }, Output>(
  next: (args: Args) => Promise<Output>,
  context: { commandName?: string },
) => (args: Args) => Promise<Output>;

/**
 * What {@link addFencingToken} needs: the `middlewareStack` of an `S3Client` (or of a
 * single command).
 */
export interface MiddlewareStackHolder {
  middlewareStack: {
    add(middleware: FencingTokenMiddleware, options: { step: 'build'; name: string; override: boolean }): void;
    remove(middleware: FencingTokenMiddleware): boolean;
  };
}

/**
 * A middleware that sets `fencing-token` on the request of every write command
 * ({@link S3_WRITE_OPERATIONS}); other commands pass untouched. Add it at the `build`
 * step, as {@link addFencingToken} does:
 *
 * ```ts
 * s3.middlewareStack.add(fencingTokenMiddleware(42), { step: 'build', name: 'fencingTokenMiddleware' });
 * ```
 *
 * `token` is checked at once when it is a token; a function is called once per write
 * command, and what it returns is checked then.
 *
 * @throws TypeError or RangeError: `token` is not a fencing token.
 */
export function fencingTokenMiddleware(token: TokenSource): FencingTokenMiddleware {
  let current: () => bigint;
  if (typeof token === 'function') {
    current = () => checkToken(token());
  } else {
    const fixed = checkToken(token);
    current = () => fixed;
  }
  return (next, context) => async (args) => {
    if (isWrite(context.commandName)) {
      const request: unknown = args.request;
      if (typeof request !== 'object' || request === null || !('headers' in request)) {
        throw new TypeError(`fencingTokenMiddleware: ${context.commandName} has no HTTP request at the build step`);
      }
      (request.headers as Record<string, string>)[FENCING_TOKEN_HEADER] = current().toString();
    }
    return next(args);
  };
}

/**
 * Adds {@link fencingTokenMiddleware} to `client` (an `S3Client`, or one command) at
 * the `build` step, so that its write commands carry the token in a signed
 * `fencing-token` header. Adding it again replaces the previous one.
 *
 * A stale token is refused by the door with S3's error document, which the SDK throws
 * as an `S3ServiceException`: `error.name === 'StaleFencingToken'`,
 * `error.$metadata.httpStatusCode === 409`. Stop the term's work then; do not retry the
 * write.
 *
 * @returns a function that removes the middleware again; calling it twice is harmless.
 */
export function addFencingToken(client: MiddlewareStackHolder, token: TokenSource): () => void {
  const middleware = fencingTokenMiddleware(token);
  const stack = client.middlewareStack;
  stack.add(middleware, { step: 'build', name: FENCING_TOKEN_MIDDLEWARE, override: true });
  return () => {
    stack.remove(middleware);
  };
}

function isWrite(commandName: string | undefined): boolean {
  return commandName !== undefined && S3_WRITE_OPERATIONS.has(commandName.replace(/Command$/, ''));
}
