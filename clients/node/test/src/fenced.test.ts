/**
 * fencedTransaction with node-postgres, through the Postgres door and straight to
 * Postgres, on a table fenced with `fencegate protect`; and `/v1/sql`.
 */

import assert from 'node:assert/strict';
import { describe, test, type TestContext } from 'node:test';

import * as fencegate from 'fencegate';
import { fencedTransaction } from 'fencegate';
import pg from 'pg';

import { defer, type FencedDatabase, fencedDatabase, type GatewayProcess, startGateway } from './harness.js';

const UPDATE = 'UPDATE sweep_state SET note = $1 WHERE id = 1';

async function connect(t: TestContext, url: string): Promise<pg.Client> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  defer(t, () => client.end());
  return client;
}

async function door(t: TestContext, db: FencedDatabase, ...extra: string[]): Promise<GatewayProcess> {
  const process = await startGateway(t, ['--database-url', db.adminUrl, ...extra]);
  assert.ok(process.pgAddr, 'the ready line names no Postgres door');
  return process;
}

async function staleRejections(process: GatewayProcess): Promise<number> {
  const metrics = await (await fetch(`${process.url}/metrics`)).text();
  const line = metrics.split('\n').find((l) => l.startsWith('fencegate_stale_rejections_total{resource="sweeper"}'));
  return line === undefined ? 0 : Number(line.split(' ').at(-1));
}

for (const path of ['door', 'direct'] as const) {
  describe(`node-postgres ${path === 'door' ? 'through the door' : 'straight to Postgres'}`, () => {
    async function writer(t: TestContext): Promise<{ client: pg.Client; db: FencedDatabase; gateway?: GatewayProcess }> {
      const db = await fencedDatabase(t);
      if (path === 'direct') return { client: await connect(t, db.writerUrl()), db };
      const gateway = await door(t, db);
      return { client: await connect(t, db.writerUrl(gateway.pgAddr)), db, gateway };
    }

    test('a stale transaction is refused with StaleToken and its fields', async (t) => {
      const { client, db, gateway } = await writer(t);
      const result = await fencedTransaction(client, 'sweeper', 2, async (tx) => {
        assert.equal(tx, client);
        return (await tx.query(UPDATE, ['sweep by node-b'])).rowCount;
      });
      assert.equal(result, 1);

      const ran: string[] = [];
      const refused = await fencedTransaction(client, 'sweeper', 1n, async (tx) => {
        ran.push('body');
        await tx.query(UPDATE, ['late write by node-a']);
      }).then(
        () => assert.fail('a stale transaction committed'),
        (error: unknown) => error,
      );
      assert.deepEqual(ran, [], 'the stale transaction failed at its fence, before any write');
      assert.ok(refused instanceof fencegate.StaleToken);
      assert.deepEqual(
        [refused.resource, refused.presented, refused.highest, refused.sqlstate, refused.status],
        ['sweeper', 1n, 2n, 'ZF001', undefined],
      );
      assert.deepEqual(
        [refused.detail['resource'], refused.detail['presented'], refused.detail['highest']],
        ['sweeper', '1', '2'],
      );
      assert.match(refused.message, /stale fencing token 1/);
      assert.ok(refused.cause instanceof Error && (refused.cause as { code?: string }).code === 'ZF001');
      assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }], 'usable after the rollback');
      assert.equal(await db.note(), 'sweep by node-b');
      if (gateway !== undefined) assert.equal(await staleRejections(gateway), 1, 'the door counted the refusal');
    });

    test('other fence errors, and errors that are not the fence', async (t) => {
      const { client, db } = await writer(t);
      // A token for another resource opens nothing here: the fence refuses it with a ZF
      // code of its own (the role holds no such resource, or the table wants its own),
      // which is neither stale nor unissued: the generic class, with its SQLSTATE.
      await assert.rejects(
        fencedTransaction(client, 'billing', 5, (tx) => tx.query(UPDATE, ['wrong resource'])),
        (error) => {
          assert.ok(error instanceof fencegate.FenceError);
          assert.equal(error.constructor, fencegate.FenceError);
          assert.match(error.sqlstate ?? '', /^ZF[0-9A-Z]{3}$/);
          assert.ok(!['ZF001', 'ZF005'].includes(error.sqlstate ?? ''));
          assert.ok(['billing', 'sweeper'].includes(error.detail['resource'] ?? ''));
          return true;
        },
      );
      await assert.rejects(
        fencedTransaction(client, 'sweeper', 3, (tx) => tx.query('SELECT 1 / 0')),
        (error) => !(error instanceof fencegate.FencegateError) && (error as { code?: string }).code === '22012',
      );
      // An error caught inside the work still leaves the transaction aborted.
      await assert.rejects(
        fencedTransaction(client, 'sweeper', 3, async (tx) => {
          await tx.query('SELECT 1 / 0').catch(() => undefined);
        }),
        /rolled back at COMMIT/,
      );
      assert.equal(await db.note(), 'initial');
    });
  });
}

test('a token the issuer never issued is TokenNotIssued', async (t) => {
  const db = await fencedDatabase(t);
  const process = await door(t, db, '--issued-by', 'gateway:sweeper');
  const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
  defer(t, () => gateway.close());
  const lease = gateway.lease('sweeper', { ttlMs: 30_000 });
  assert.ok(await lease.acquire({ wait: false }));
  const client = await connect(t, db.writerUrl(process.pgAddr));
  const forged = lease.token + 5n;
  await assert.rejects(
    fencedTransaction(client, 'sweeper', forged, (tx) => tx.query(UPDATE, ['forged'])),
    (error) => {
      assert.ok(error instanceof fencegate.TokenNotIssued);
      assert.deepEqual([error.resource, error.presented, error.issued, error.sqlstate], ['sweeper', forged, lease.token, 'ZF005']);
      return true;
    },
  );
  await lease.transaction(client, (tx) => tx.query(UPDATE, ["by the lease's term"]));
  assert.equal((await gateway.fence('sweeper')).highest, lease.token, 'the forged token did not move the fence');
  await lease.release();
  assert.equal(await db.note(), "by the lease's term");
});

test('a stale transaction under a lease ends its term', async (t) => {
  const db = await fencedDatabase(t);
  const process = await door(t, db);
  const gateway = new fencegate.Gateway(process.url, { holder: 'node-a' });
  defer(t, () => gateway.close());
  const pool = new pg.Pool({ connectionString: db.writerUrl(process.pgAddr), max: 2 });
  defer(t, () => pool.end());
  const lease = gateway.lease('sweeper', { ttlMs: 30_000 });
  assert.ok(await lease.acquire({ wait: false }));
  const client = await pool.connect();
  try {
    await lease.transaction(client, (tx) => tx.query(UPDATE, ["node-a's term"]));
    await gateway.advance('sweeper', { token: lease.token + 1n }); // a newer term, elsewhere
    await assert.rejects(lease.transaction(client, (tx) => tx.query(UPDATE, ['late'])), fencegate.StaleToken);
    assert.equal(lease.reason, 'stale_token');
    assert.ok(lease.signal.aborted);
    await assert.rejects(lease.transaction(client, (tx) => tx.query('SELECT 1')), fencegate.LeaseLost);
  } finally {
    client.release();
  }
  assert.equal(await db.note(), "node-a's term");
});

test('/v1/sql: statements after the fence, in one transaction', async (t) => {
  const db = await fencedDatabase(t);
  const process = await startGateway(t, ['--database-url', db.adminUrl, '--sql', '--sql-database-url', db.sqlUrl]);
  const gateway = new fencegate.Gateway(process.url, { holder: 'node-b' });
  defer(t, () => gateway.close());

  const outcome = await gateway.sql(
    'sweeper',
    [{ sql: UPDATE, params: ['sweep by node-b'] }, { sql: 'SELECT id, note FROM sweep_state WHERE id = $1', params: [1] }],
    { token: 2, idempotencyKey: 'sweep-2' },
  );
  assert.deepEqual([outcome.resource, outcome.token], ['sweeper', 2n]);
  assert.equal(outcome.results[0]?.rowsAffected, 1);
  assert.deepEqual(outcome.results[1]?.columns.map((column) => column.name), ['id', 'note']);
  assert.deepEqual(outcome.results[1]?.rows, [[1, 'sweep by node-b']]);
  assert.equal(outcome.replayed, false);
  const again = await gateway.sql(
    'sweeper',
    [{ sql: UPDATE, params: ['sweep by node-b'] }, { sql: 'SELECT id, note FROM sweep_state WHERE id = $1', params: [1] }],
    { token: 2, idempotencyKey: 'sweep-2' },
  );
  assert.ok(again.replayed, 'the stored answer, not a second run');
  assert.deepEqual(again.results, outcome.results);

  await assert.rejects(gateway.sql('sweeper', [{ sql: UPDATE, params: ['late'] }], { token: 1 }), (error) => {
    assert.ok(error instanceof fencegate.StaleToken);
    assert.deepEqual([error.presented, error.highest], [1n, 2n]);
    return true;
  });
  await assert.rejects(
    gateway.sql('sweeper', ["UPDATE sweep_state SET note = 'half' WHERE id = 1", 'SELECT 1 / 0'], { token: 2 }),
    (error) => {
      assert.ok(error instanceof fencegate.SqlError);
      assert.deepEqual([error.statement, error.sqlstate, error.status], [1, '22012', 400]);
      return true;
    },
  );

  const lease = gateway.lease('sweeper', { ttlMs: 30_000 });
  assert.ok(await lease.acquire({ wait: false }));
  await lease.sql([{ sql: UPDATE, params: ['by the lease'] }]);
  await gateway.advance('sweeper', { token: lease.token + 1n });
  await assert.rejects(lease.sql(["UPDATE sweep_state SET note = 'late' WHERE id = 1"]), fencegate.StaleToken);
  assert.equal(lease.reason, 'stale_token');
  assert.equal(await db.note(), 'by the lease');
});
