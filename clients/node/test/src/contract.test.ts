/** The error classes against the gateway's contract, and the package as installed. */

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import * as fencegate from 'fencegate';

import { REPO } from './harness.js';

function openapiCodes(): Set<string> {
  const document = JSON.parse(readFileSync(join(REPO, 'gateway', 'openapi.json'), 'utf8')) as {
    components: { schemas: { ErrorCode: { enum: string[] } } };
  };
  return new Set(document.components.schemas.ErrorCode.enum);
}

/** The codes of the README's error table (the one with an `error` column). */
function readmeCodes(): Set<string> {
  const codes = new Set<string>();
  let inTable = false;
  for (const line of readFileSync(join(REPO, 'README.md'), 'utf8').split('\n')) {
    if (line.startsWith('| Status | `error` |')) {
      inTable = true;
      continue;
    }
    if (inTable && !line.startsWith('|')) break;
    if (inTable) for (const match of (line.split('|')[2] ?? '').matchAll(/`([a-z_]+)`/g)) codes.add(match[1]!);
  }
  return codes;
}

const difference = (a: Set<string>, b: Set<string>): string[] => [...a].filter((item) => !b.has(item)).sort();

test('every code of openapi.json has a class, and every class a code', () => {
  const documented = openapiCodes();
  assert.ok(documented.size >= 30, 'the ErrorCode enum of openapi.json was not found whole');
  const classes = new Set(fencegate.ERROR_CLASSES.keys());
  assert.deepEqual(difference(documented, classes), [], 'codes of gateway/openapi.json without an error class');
  assert.deepEqual(difference(classes, documented), [], 'error classes whose code gateway/openapi.json does not list');
});

test("the README's error table lists the same codes", () => {
  assert.deepEqual([...readmeCodes()].sort(), [...fencegate.ERROR_CLASSES.keys()].sort());
});

test('classes are exported and named after their code', () => {
  const exported = fencegate as unknown as Record<string, unknown>;
  for (const [code, cls] of fencegate.ERROR_CLASSES) {
    assert.equal(exported[cls.name], cls);
    assert.equal(cls.name.toLowerCase(), code.replaceAll('_', ''));
    assert.ok(new cls('m') instanceof fencegate.FencegateError);
    assert.equal(new cls('m').code, code);
  }
});

test('SQL fence errors are parsed from their DETAIL', () => {
  const stale = fencegate.fenceErrorFromSqlstate('ZF001', 'stale', 'resource=sweeper presented=1 highest=2');
  assert.ok(stale instanceof fencegate.StaleToken);
  assert.deepEqual([stale.resource, stale.presented, stale.highest, stale.sqlstate], ['sweeper', 1n, 2n, 'ZF001']);
  assert.equal(stale.status, undefined);
  const unissued = fencegate.fenceErrorFromSqlstate('ZF005', 'no', 'resource=orders presented=9 issued=3');
  assert.ok(unissued instanceof fencegate.TokenNotIssued);
  assert.deepEqual([unissued.presented, unissued.issued], [9n, 3n]);
  const other = fencegate.fenceErrorFromSqlstate('ZF002', 'no token', 'resource=sweeper');
  assert.equal(other.constructor, fencegate.FenceError);
  assert.deepEqual([other.sqlstate, other.detail], ['ZF002', { resource: 'sweeper' }]);
  assert.equal(fencegate.fenceError(new Error('unrelated')), undefined);
  const wrapped = new Error('an ORM', { cause: Object.assign(new Error('stale'), { code: 'ZF001', detail: 'resource=r presented=4 highest=9' }) });
  assert.equal(fencegate.fenceError(wrapped)?.constructor, fencegate.StaleToken);
});

test('tokens are checked before anything is sent, and kept exact', async () => {
  const gateway = new fencegate.Gateway('http://127.0.0.1:9');
  for (const token of [0, -1, 1.5, 2n ** 63n]) {
    await assert.rejects(gateway.put('r', 'k', 'v', { token }), /fencing token/);
  }
  assert.equal(fencegate.checkToken(fencegate.MAX_TOKEN), 2n ** 63n - 1n);
  gateway.close();
});

test('a token past 2^53 given as a number is refused with what to pass instead', () => {
  // 2 ** 60 is exact, but any number this large stands for many integers: refused all the same.
  for (const token of [2 ** 60, Number.MAX_SAFE_INTEGER + 1, 1e300]) {
    assert.throws(
      () => fencegate.checkToken(token),
      (error: unknown) => {
        assert.ok(error instanceof TypeError);
        assert.match(error.message, /above 2\^53 must be passed as a bigint/);
        assert.match(error.message, /2n \*\* 60n or BigInt\("1152921504606846976"\)/);
        return true;
      },
    );
  }
  assert.equal(fencegate.checkToken(2n ** 60n), 1152921504606846976n);
  assert.equal(fencegate.checkToken(BigInt('1152921504606846976')), 2n ** 60n);
  assert.equal(fencegate.checkToken(Number.MAX_SAFE_INTEGER), 2n ** 53n - 1n);
  assert.throws(() => fencegate.checkToken(1.5), /a fencing token is an integer, not 1\.5/);
  assert.throws(() => fencegate.checkToken('7' as unknown as number), /a bigint or an integer number, not string 7/);
});

test('lease timing defaults and checks', () => {
  // The same numbers in every client: step down 2 s before the lease can pass, retry a
  // failed renewal every 0.5 s, each attempt at most 1 s; acquire retries unchanged.
  assert.deepEqual(fencegate.leaseTiming({ ttlMs: 15_000 }), {
    ttlMs: 15_000,
    marginMs: 2_000,
    renewEveryMs: 5_000,
    retryEveryMs: 1_500,
    renewRetryEveryMs: 500,
    renewTimeoutMs: 1_000,
  });
  assert.equal(fencegate.leaseTiming({ ttlMs: 3_000, renewRetryEveryMs: 50, renewTimeoutMs: 300 }).renewRetryEveryMs, 50);
  assert.throws(() => fencegate.leaseTiming({ ttlMs: 1_000, marginMs: 500, renewEveryMs: 600 }), /renewEveryMs/);
  assert.throws(() => fencegate.leaseTiming({ ttlMs: 1_000, marginMs: 1_000 }), /marginMs/);
  // A renewal sent just before the step-down must be able to land before the lease passes.
  assert.throws(
    () => fencegate.leaseTiming({ ttlMs: 15_000, marginMs: 1_000 }),
    /marginMs \(1000\) must be above renewTimeoutMs \(1000\)/,
  );
  assert.throws(() => fencegate.leaseTiming({ ttlMs: 3_000, renewTimeoutMs: 500 }), /must be above renewTimeoutMs/);
  assert.equal(fencegate.leaseTiming({ ttlMs: 15_000, marginMs: 1_000, renewTimeoutMs: 500 }).marginMs, 1_000);
  assert.throws(() => fencegate.leaseTiming({ renewRetryEveryMs: 0 }), /renewRetryEveryMs/);
  assert.throws(() => fencegate.leaseTiming({ renewTimeoutMs: 0 }), /renewTimeoutMs/);
});

test('the package under test is the installed tarball', () => {
  const require = createRequire(import.meta.url);
  const manifest = require.resolve('fencegate/package.json');
  assert.match(manifest, /\/node_modules\/fencegate\/package\.json$/);
  const entry = fileURLToPath(import.meta.resolve('fencegate'));
  assert.match(entry, /\/node_modules\/fencegate\/dist\/index\.js$/);
  const pkg = JSON.parse(readFileSync(manifest, 'utf8')) as { version: string; dependencies?: object; types: string };
  assert.equal(pkg.version, fencegate.VERSION);
  assert.equal(pkg.dependencies, undefined, 'no runtime dependency');
  assert.match(readFileSync(join(manifest, '..', pkg.types), 'utf8'), /export \{[^}]*\bGateway\b/);
  assert.match(readFileSync(join(manifest, '..', 'dist', 'gateway.d.ts'), 'utf8'), /export declare class Gateway/);
});
