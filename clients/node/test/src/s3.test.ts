/**
 * addFencingToken on a real `@aws-sdk/client-s3` client, against a local HTTP server
 * that records what it is sent and answers each request as told. Compiling this file
 * also checks that an `S3Client` fits the package's structural types. The S3 door
 * itself is driven through this SDK by the Rust suite (`tests/tests/it/s3_clients.rs`),
 * which needs radosgw.
 */

import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { test, type TestContext } from 'node:test';

import {
  AbortMultipartUploadCommand,
  CompleteMultipartUploadCommand,
  CopyObjectCommand,
  CreateMultipartUploadCommand,
  DeleteObjectCommand,
  DeleteObjectsCommand,
  GetObjectCommand,
  HeadObjectCommand,
  ListObjectsV2Command,
  PutObjectCommand,
  S3Client,
  UploadPartCommand,
  UploadPartCopyCommand,
} from '@aws-sdk/client-s3';
import * as fencegate from 'fencegate';
import { addFencingToken, fencingTokenMiddleware, S3_WRITE_OPERATIONS } from 'fencegate';

import { defer } from './harness.js';

interface Sent {
  method: string;
  url: string;
  headers: Record<string, string | string[] | undefined>;
}

function token(sent: Sent): string | undefined {
  const value = sent.headers['fencing-token'];
  return typeof value === 'string' ? value : undefined;
}

/** The names in the Authorization header's SignedHeaders. */
function signed(sent: Sent): string[] {
  const authorization = String(sent.headers['authorization']);
  return (authorization.split('SignedHeaders=')[1] ?? '').split(',')[0]!.split(';');
}

const ANSWER = '<Result/>';

/** A server that records requests, and answers `statuses` first, then 200s. */
async function recorder(t: TestContext): Promise<{ sent: Sent[]; statuses: number[]; endpoint: string }> {
  const sent: Sent[] = [];
  const statuses: number[] = [];
  const server = createServer((request, response) => {
    request.resume();
    request.on('end', () => {
      sent.push({ method: request.method ?? '', url: request.url ?? '', headers: request.headers });
      // An empty XML document: the SDK takes an empty 200 to CopyObject or
      // CompleteMultipartUpload for an aborted request.
      response.writeHead(statuses.shift() ?? 200, { 'content-type': 'application/xml', 'content-length': ANSWER.length });
      response.end(request.method === 'HEAD' ? undefined : ANSWER);
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  defer(t, () => new Promise((resolve) => server.close(resolve)));
  defer(t, () => server.closeAllConnections());
  return { sent, statuses, endpoint: `http://127.0.0.1:${(server.address() as AddressInfo).port}` };
}

function s3Client(t: TestContext, endpoint: string, maxAttempts = 1): S3Client {
  const s3 = new S3Client({
    endpoint,
    region: 'us-east-1',
    forcePathStyle: true,
    credentials: { accessKeyId: 'FGWRITER', secretAccessKey: 'writer-secret' },
    maxAttempts,
  });
  defer(t, () => s3.destroy());
  return s3;
}

const B = { Bucket: 'data', Key: 'orders/2026-12.json' };
const UPLOAD = { ...B, UploadId: 'u-1' };

// Every write, as the SDK sends it.
const WRITES: Record<string, (s3: S3Client) => Promise<unknown>> = {
  PutObject: (s3) => s3.send(new PutObjectCommand({ ...B, Body: 'term 7' })),
  CopyObject: (s3) => s3.send(new CopyObjectCommand({ ...B, CopySource: 'data/orders/2026-11.json' })),
  DeleteObject: (s3) => s3.send(new DeleteObjectCommand(B)),
  DeleteObjects: (s3) => s3.send(new DeleteObjectsCommand({ Bucket: 'data', Delete: { Objects: [{ Key: B.Key }] } })),
  CreateMultipartUpload: (s3) => s3.send(new CreateMultipartUploadCommand(B)),
  UploadPart: (s3) => s3.send(new UploadPartCommand({ ...UPLOAD, PartNumber: 1, Body: 'part' })),
  UploadPartCopy: (s3) => s3.send(new UploadPartCopyCommand({ ...UPLOAD, PartNumber: 1, CopySource: 'data/o' })),
  CompleteMultipartUpload: (s3) =>
    s3.send(new CompleteMultipartUploadCommand({ ...UPLOAD, MultipartUpload: { Parts: [{ ETag: '"e"', PartNumber: 1 }] } })),
  AbortMultipartUpload: (s3) => s3.send(new AbortMultipartUploadCommand(UPLOAD)),
};

test('every write carries the token as a signed header', async (t) => {
  assert.deepEqual(new Set(Object.keys(WRITES)), S3_WRITE_OPERATIONS);
  const { sent, endpoint } = await recorder(t);
  const s3 = s3Client(t, endpoint);
  addFencingToken(s3, 7);
  for (const write of Object.values(WRITES)) await write(s3);
  assert.equal(sent.length, Object.keys(WRITES).length);
  for (const [index, operation] of Object.keys(WRITES).entries()) {
    const request = sent[index]!;
    assert.equal(token(request), '7', `${operation}: ${JSON.stringify(request.headers)}`);
    assert.ok(signed(request).includes('fencing-token'), `${operation}: ${String(request.headers['authorization'])}`);
  }
});

test('reads carry no token', async (t) => {
  const { sent, endpoint } = await recorder(t);
  const s3 = s3Client(t, endpoint);
  addFencingToken(s3, 7);
  await s3.send(new GetObjectCommand(B));
  await s3.send(new HeadObjectCommand(B));
  await s3.send(new ListObjectsV2Command({ Bucket: 'data' }));
  assert.deepEqual(
    sent.map((request) => [request.method, token(request)]),
    [
      ['GET', undefined],
      ['HEAD', undefined],
      ['GET', undefined],
    ],
  );
});

test('a token function is read once per command, and resends keep its token', async (t) => {
  const recorded = await recorder(t);
  const s3 = s3Client(t, recorded.endpoint, 2);
  const tokens = [41n, 42n];
  const read: bigint[] = [];
  addFencingToken(s3, () => {
    read.push(tokens.shift()!);
    return read.at(-1)!;
  });
  recorded.statuses.push(503); // the first attempt fails; the SDK resends the command
  await s3.send(new PutObjectCommand({ ...B, Body: 'term 41' }));
  await s3.send(new DeleteObjectCommand(B));
  assert.deepEqual(read, [41n, 42n]);
  assert.deepEqual(
    recorded.sent.map((request) => [request.method, token(request)]),
    [
      ['PUT', '41'],
      ['PUT', '41'],
      ['DELETE', '42'],
    ],
  );
});

test('a token source that throws stops the command before it is sent', async (t) => {
  const { sent, endpoint } = await recorder(t);
  const s3 = s3Client(t, endpoint);
  addFencingToken(s3, () => {
    throw new fencegate.LeaseLost('the term is over');
  });
  await assert.rejects(s3.send(new PutObjectCommand({ ...B, Body: 'after the term' })), fencegate.LeaseLost);
  addFencingToken(s3, () => 0); // replaces the previous middleware
  await assert.rejects(s3.send(new PutObjectCommand({ ...B, Body: 'x' })), RangeError);
  assert.deepEqual(sent, []);
});

test('a bad token is refused at once', () => {
  assert.throws(() => fencingTokenMiddleware(0), RangeError);
  assert.throws(() => fencingTokenMiddleware(2n ** 63n), RangeError);
  assert.throws(() => fencingTokenMiddleware(2 ** 60), TypeError);
  assert.throws(() => fencingTokenMiddleware('7' as unknown as number), TypeError);
});

test('adding it again replaces the token; removing it takes the header off', async (t) => {
  const { sent, endpoint } = await recorder(t);
  const s3 = s3Client(t, endpoint);
  const first = addFencingToken(s3, 7);
  await s3.send(new PutObjectCommand({ ...B, Body: 'term 7' }));
  const remove = addFencingToken(s3, 2n ** 60n);
  await s3.send(new PutObjectCommand({ ...B, Body: 'a big term' }));
  first(); // already replaced: nothing to remove
  await s3.send(new PutObjectCommand({ ...B, Body: 'still the big term' }));
  remove();
  remove();
  await s3.send(new PutObjectCommand({ ...B, Body: 'plain' }));
  assert.deepEqual(sent.map(token), ['7', (2n ** 60n).toString(), (2n ** 60n).toString(), undefined]);
});

test('the middleware can be added by hand, to one command', async (t) => {
  const { sent, endpoint } = await recorder(t);
  const s3 = s3Client(t, endpoint);
  const command = new DeleteObjectCommand(B);
  command.middlewareStack.add(fencingTokenMiddleware(9), { step: 'build', name: 'fencingTokenMiddleware' });
  await s3.send(command);
  await s3.send(new DeleteObjectCommand(B));
  assert.deepEqual(sent.map(token), ['9', undefined]);
});
