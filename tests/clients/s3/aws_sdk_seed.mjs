// The S3 door's seed scenario, driven by @aws-sdk/client-s3 (pinned in
// ../node/package-lock.json) with nothing changed but the endpoint and path-style URLs.
//
//   node aws_sdk_seed.mjs ENDPOINT ACCESS_KEY SECRET BUCKET KEY TERM [FENCEGATE]
//
// Term TERM writes KEY, term TERM+1 writes it, then term TERM's late PUT must be refused
// with 409 StaleFencingToken and `Fencing-Highest: TERM+1`, and the object must still hold
// term TERM+1's bytes. The token travels as object metadata (`Metadata: {
// 'fencing-token': ... }`). With FENCEGATE, the path of the fencegate package's compiled
// index.js, term TERM tries again with the package's middleware, the token in a signed
// `fencing-token` header: a late PUT and a DeleteObject, both refused the same way.
// Exits non-zero, saying why, when anything differs.

import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

// The SDK is installed in ../node (npm ci there), not next to this script.
const require = createRequire(new URL('../node/package.json', import.meta.url));
const { DeleteObjectCommand, GetObjectCommand, PutObjectCommand, S3Client } = require('@aws-sdk/client-s3');

const [endpoint, accessKeyId, secretAccessKey, bucket, key, first, fencegatePath] = process.argv.slice(2);
const term = Number(first);

function fail(message) {
  console.error(message);
  process.exit(1);
}

function client() {
  return new S3Client({
    endpoint,
    region: 'us-east-1',
    forcePathStyle: true,
    credentials: { accessKeyId, secretAccessKey },
    maxAttempts: 1,
  });
}

const s3 = client();

function put(token, body) {
  return s3.send(
    new PutObjectCommand({ Bucket: bucket, Key: key, Body: body, Metadata: { 'fencing-token': String(token) } }),
  );
}

async function refused(what, sent) {
  try {
    await sent;
  } catch (error) {
    const status = error.$metadata?.httpStatusCode;
    const highest = error.$response?.headers?.['fencing-highest'];
    if (status !== 409 || error.name !== 'StaleFencingToken' || error.Code !== 'StaleFencingToken') {
      fail(`the ${what} was refused with ${status} ${error.name} (Code ${error.Code}): ${error.message}`);
    }
    if (highest !== String(term + 1)) fail(`the ${what}'s refusal says Fencing-Highest ${highest}`);
    console.log(`${what} refused: ${error.name} (${error.message})`);
    return;
  }
  fail(`the ${what} of an older term was accepted`);
}

async function held() {
  const answer = await s3.send(new GetObjectCommand({ Bucket: bucket, Key: key }));
  const body = await answer.Body.transformToString();
  if (body !== `term ${term + 1}`) fail(`the object holds ${JSON.stringify(body)}, not term ${term + 1}'s bytes`);
  return answer;
}

await put(term, `term ${term}`);
await put(term + 1, `term ${term + 1}`);
await refused('late PUT', put(term, `term ${term}, late`));
const answer = await held();
if (answer.Metadata?.['fencing-token'] !== String(term + 1)) {
  fail(`the object's metadata names token ${answer.Metadata?.['fencing-token']}, not ${term + 1}`);
}
console.log(`the object holds "term ${term + 1}"`);

if (fencegatePath !== undefined) {
  const { addFencingToken } = await import(pathToFileURL(fencegatePath).href);
  const late = client();
  addFencingToken(late, BigInt(term));
  // What each write sent, read after signing (the deserialize step sees the signed request).
  const sent = [];
  late.middlewareStack.add(
    (next) => async (args) => {
      sent.push({ ...args.request.headers });
      return next(args);
    },
    { step: 'deserialize', name: 'recordSentHeaders' },
  );
  await refused('late PUT with the middleware', late.send(new PutObjectCommand({ Bucket: bucket, Key: key, Body: 'late, by header' })));
  await refused('late DELETE with the middleware', late.send(new DeleteObjectCommand({ Bucket: bucket, Key: key })));
  if (sent.length !== 2) fail(`the middleware's client sent ${sent.length} requests, not 2`);
  for (const headers of sent) {
    const signed = (headers['authorization'] ?? '').split('SignedHeaders=')[1]?.split(',')[0]?.split(';') ?? [];
    if (headers['fencing-token'] !== String(term) || !signed.includes('fencing-token')) {
      fail(`a write did not carry a signed fencing-token ${term}: ${JSON.stringify(headers)}`);
    }
    if ('x-amz-meta-fencing-token' in headers) fail('a write carried a metadata token too');
  }
  console.log('the middleware sent the token as a signed header');
  await held();
  console.log(`the object still holds "term ${term + 1}"`);
  late.destroy();
}
s3.destroy();
