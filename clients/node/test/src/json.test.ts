/**
 * `JSON.stringify` of every kind of result and of an error, against the real gateway on
 * Postgres (with `/v1/sql`), with tokens past 2^53: bigints come out as exact decimal
 * strings, an object's value as base64.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';

import * as fencegate from 'fencegate';

import { defer, fencedDatabase, startGateway } from './harness.js';

const BIG = 2n ** 60n; // past Number.MAX_SAFE_INTEGER: a number would lose its last digits

/** What `JSON.stringify` wrote, read back. */
function written(value: unknown): unknown {
  return JSON.parse(JSON.stringify(value));
}

test('JSON.stringify writes every result and error, tokens as decimal strings', async (t) => {
  const db = await fencedDatabase(t);
  const process = await startGateway(t, ['--database-url', db.adminUrl, '--sql', '--sql-database-url', db.sqlUrl]);
  const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
  defer(t, () => gateway.close());
  const token = BIG.toString();

  // A write, a read, a delete.
  const put = await gateway.put('orders', 'o-1', 'from the big term', { token: BIG });
  assert.deepEqual(written(put), { resource: 'orders', key: 'o-1', token, version: 1, created: true, replayed: false });
  const stored = await gateway.get('orders', 'o-1');
  assert.deepEqual(written(stored), {
    value: Buffer.from('from the big term').toString('base64'),
    version: 1,
    token,
  });
  const deleted = await gateway.delete('orders', 'o-1', { token: BIG });
  assert.deepEqual(written(deleted), { resource: 'orders', key: 'o-1', token, version: 2, created: false, replayed: false });

  // Fences.
  assert.deepEqual(written(await gateway.fence('orders')), { resource: 'orders', highest: token, replayed: false });
  assert.deepEqual(written(await gateway.fence('never-written')), { resource: 'never-written', highest: null, replayed: false });
  assert.deepEqual(written(await gateway.advance('orders', { token: BIG + 1n })), {
    resource: 'orders',
    highest: (BIG + 1n).toString(),
    replayed: false,
  });

  // Lease states: acquire, renew, read.
  await gateway.advance('sweeper', { token: BIG });
  const acquired = await gateway.acquireLease('sweeper', { ttlMs: 30_000 });
  const leaseToken = (BIG + 1n).toString();
  const leaseJson = written(acquired) as Record<string, unknown>;
  assert.deepEqual(
    [leaseJson['resource'], leaseJson['held'], leaseJson['holder'], leaseJson['token'], typeof leaseJson['expiresInMs']],
    ['sweeper', true, 'node-a', leaseToken, 'number'],
  );
  const renewed = await gateway.renewLease('sweeper', { token: BIG + 1n, ttlMs: 30_000 });
  assert.equal((written(renewed) as Record<string, unknown>)['token'], leaseToken);
  assert.equal((written(await gateway.readLease('sweeper')) as Record<string, unknown>)['token'], leaseToken);
  await gateway.releaseLease('sweeper', { token: BIG + 1n });

  // /v1/sql.
  const sql = await gateway.sql('sweeper', [{ sql: 'SELECT id, note FROM sweep_state WHERE id = $1', params: [1] }], {
    token: BIG + 1n,
  });
  assert.deepEqual(written(sql), {
    resource: 'sweeper',
    token: leaseToken,
    results: [
      {
        rowsAffected: 1,
        columns: [
          { name: 'id', type: 'int4' },
          { name: 'note', type: 'text' },
        ],
        rows: [[1, 'initial']],
        truncated: false,
      },
    ],
    replayed: false,
  });

  // A transaction: its outcome, and each kind of operation's result.
  const txnToken = BIG + 2n;
  const outcome = await gateway.txn([
    { op: 'put', resource: 'shard-7', key: 'owner', value: 'node-a', token: txnToken },
    { op: 'delete', resource: 'shard-7', key: 'handoff', token: txnToken },
    { op: 'advance', resource: 'queue-7', token: txnToken },
    { op: 'check', resource: 'cluster-config', token: txnToken, key: 'layout', version: 0 },
  ]);
  const text = txnToken.toString();
  assert.deepEqual(written(outcome), {
    results: [
      { op: 'put', resource: 'shard-7', token: text, key: 'owner', version: 1, created: true },
      { op: 'delete', resource: 'shard-7', token: text, key: 'handoff', version: 0 },
      { op: 'advance', resource: 'queue-7', token: text },
      { op: 'check', resource: 'cluster-config', token: text, key: 'layout', version: 0 },
    ],
    replayed: false,
  });
  assert.deepEqual(written(outcome.results[2]), { op: 'advance', resource: 'queue-7', token: text });

  // Under a lease.
  const lease = gateway.lease('leased', { ttlMs: 30_000 });
  assert.ok(await lease.acquire({ wait: false }));
  assert.equal((written(await lease.put('k', 'v')) as Record<string, unknown>)['token'], lease.token.toString());
  await lease.release();

  // An error that carries tokens.
  const refused = await gateway.put('orders', 'o-1', 'late', { token: BIG }).then(
    () => assert.fail('a stale write was accepted'),
    (error: unknown) => error,
  );
  assert.ok(refused instanceof fencegate.StaleToken);
  const error = written(refused) as Record<string, unknown>;
  assert.deepEqual(
    [error['name'], error['code'], error['status'], error['presented'], error['highest']],
    ['StaleToken', 'stale_token', 409, token, (BIG + 1n).toString()],
  );
  assert.match(String(error['message']), /stale fencing token/);

  // A copy loses toJSON, which is not enumerable; jsonReplacer writes it all the same.
  assert.throws(() => JSON.stringify({ ...put }), /BigInt/);
  assert.deepEqual(JSON.parse(JSON.stringify({ ...put, note: 'copied' }, fencegate.jsonReplacer)), {
    resource: 'orders',
    key: 'o-1',
    token,
    version: 1,
    created: true,
    replayed: false,
    note: 'copied',
  });
});
