#!/usr/bin/env node
// The fencing scenarios through node-postgres (`pg`, pure JavaScript protocol code),
// against FENCEGATE_CLIENT_DSN.
//
// Starts from the state tests/clients/fixture.sh leaves (sweep_state row 1 'initial',
// resource `sweeper` with no token yet) and moves `sweeper` through terms 42 and 43,
// so it runs once per fresh fixture. Prints one line per check and `ok <n> checks`,
// or `FAIL <scenario>: <what differed>` and exits 1. See ../README.md.
//
// node-postgres sends a query without values as one simple query, and one with values
// as Parse/Bind/Describe/Execute/Sync: every query is its own Sync, even pipelined.
'use strict'

const crypto = require('node:crypto')
const { pipeline: streamPipeline } = require('node:stream/promises')
const { Readable, Writable } = require('node:stream')
const { Client, Query } = require('pg')
const copyStreams = require('pg-copy-streams')

const DSN = process.env.FENCEGATE_CLIENT_DSN
const SCENARIO_TIMEOUT_MS = 20_000

const UPDATE = 'UPDATE sweep_state SET note = $1 WHERE id = 1'
const INSERT = 'INSERT INTO sweep_state (id, note) VALUES ($1, $2)'
const MULTI =
  "BEGIN; SELECT fencegate.fence('sweeper', 42);" +
  " UPDATE sweep_state SET note = 'multi-1' WHERE id = 1; COMMIT;" +
  " UPDATE sweep_state SET note = 'multi-2' WHERE id = 1"
const STALE_DETAIL = 'resource=sweeper presented=41 highest=42'
const BLOB = Buffer.alloc(16 * 1024 * 1024, Buffer.from([...Array(256).keys()])) // 16 MiB, every byte value

let checks = 0

class Mismatch extends Error {}

function check(name, got, want) {
  const [g, w] = [JSON.stringify(got), JSON.stringify(want)]
  if (g !== w) throw new Mismatch(`${name}: expected ${w}, got ${g}`)
  checks += 1
  console.log(`ok ${name}`)
}

// Runs fn with fresh connections (one per entry of `configs`), closing them after.
async function withClients(configs, fn) {
  const clients = configs.map((extra) => new Client({ connectionString: DSN, connectionTimeoutMillis: 10_000, ...extra }))
  try {
    await Promise.all(clients.map((c) => c.connect()))
    return await fn(...clients)
  } finally {
    await Promise.all(clients.map((c) => c.end().catch(() => {})))
  }
}

// Awaits; returns the server error it failed with (one that carries a SQLSTATE), or null.
async function errorOf(promise) {
  try {
    await promise
  } catch (err) {
    if (err.code === undefined) throw err
    return err
  }
  return null
}

function checkError(name, err, sqlstate, detail) {
  check(`${name}: SQLSTATE`, err && err.code, sqlstate)
  if (detail !== undefined) {
    const [fields, proof] = (err.detail || '').split(' proof=')
    check(`${name}: DETAIL`, fields, detail)
    check(`${name}: DETAIL proof`, /^[0-9a-f]{64}$/.test(proof || ''), true)
    check(`${name}: HINT non-empty`, Boolean(err.hint), true)
  }
}

async function scalar(client, sql, values) {
  const res = await client.query({ text: sql, values, rowMode: 'array' })
  return res.rows[0][0]
}

const note = (client) => scalar(client, 'SELECT note FROM sweep_state WHERE id = 1')
const digest = (buf) => [buf.length, crypto.createHash('sha256').update(buf).digest('hex')]

async function seed() {
  await withClients([{}, {}], async (b, a) => {
    // node-b, term 42, literal SQL (simple queries)
    await b.query('BEGIN')
    await b.query("SELECT fencegate.fence('sweeper', 42)")
    await b.query("UPDATE sweep_state SET note = 'node-b' WHERE id = 1")
    await b.query('COMMIT')
    // the delayed term-41 transaction, bind parameters
    await a.query('BEGIN')
    const err = await errorOf(a.query('SELECT fencegate.fence($1, $2)', ['sweeper', 41]))
    await a.query('ROLLBACK')
    checkError('seed: node-a (41) after node-b (42)', err, 'ZF001', STALE_DETAIL)
    check('seed: row still reads node-b', await note(a), 'node-b')
  })
}

async function startupOptions() {
  await withClients([{ options: '-c fencegate.token=42' }, { options: '-c fencegate.token=41' }], async (c42, c41) => {
    check('options 42: UPDATE outside a transaction', (await c42.query(UPDATE, ['options-42'])).rowCount, 1)
    checkError('options 41: UPDATE', await errorOf(c41.query(UPDATE, ['options-41'])), 'ZF001', STALE_DETAIL)
    check('options 41: row reads options-42', await note(c41), 'options-42')
  })
}

async function noToken() {
  await withClients([{}], async (c) => {
    checkError('no token: UPDATE', await errorOf(c.query(UPDATE, ['no-token'])), 'ZF002')
  })
}

async function abortedTransaction() {
  await withClients([{}], async (c) => {
    await c.query('BEGIN')
    checkError('aborted tx: stale fence()', await errorOf(c.query('SELECT fencegate.fence($1, $2)', ['sweeper', 41])), 'ZF001')
    checkError('aborted tx: next statement', await errorOf(c.query('SELECT 1')), '25P02')
    await c.query('ROLLBACK')
    check('aborted tx: usable after ROLLBACK', await scalar(c, 'SELECT 1'), 1)
  })
}

// node-postgres 8.23's `pipeline: true` writes queries without waiting for answers, but
// each carries its own Sync, so each is its own implicit transaction: the stale one
// fails alone and the others land (unlike a libpq pipeline or a JDBC batch).
async function pipelined() {
  await withClients([{ pipeline: true, options: '-c fencegate.token=42' }], async (c) => {
    const [first, stale, third] = await Promise.allSettled([
      c.query(INSERT, [10, 'pipelined']),
      c.query('SELECT fencegate.fence($1, $2)', ['sweeper', 41]),
      c.query(INSERT, [11, 'pipelined']),
    ])
    check('pipelined: first query', first.status, 'fulfilled')
    checkError('pipelined: stale second query', stale.reason, 'ZF001', STALE_DETAIL)
    check('pipelined: third query', third.status, 'fulfilled')
    check('pipelined: rows of the first and third', await scalar(c, 'SELECT array_agg(id ORDER BY id) FROM sweep_state WHERE id >= 10'), [10, 11])
  })
}

async function multiStatement() {
  await withClients([{}], async (c) => {
    checkError('multi-statement: UPDATE after COMMIT', await errorOf(c.query(MULTI)), 'ZF002')
    check('multi-statement: part before COMMIT committed', await note(c), 'multi-1')
  })
}

async function copy() {
  const copyIn = (c, text) => streamPipeline(Readable.from([text]), c.query(copyStreams.from('COPY sweep_state (id, note) FROM STDIN')))
  await withClients([{}], async (c) => {
    await c.query('BEGIN')
    check('copy: fence term 43', await scalar(c, 'SELECT fencegate.fence($1, $2)', ['sweeper', 43]), '43') // bigint reads as a string
    await copyIn(c, '20\tcopy-20\n21\tcopy-21\n')
    await c.query('COMMIT')
    checkError('copy: COPY FROM without a token', await errorOf(copyIn(c, '22\tcopy-22\n')), 'ZF002')
    const chunks = []
    const sink = new Writable({ write: (chunk, _enc, done) => done(null, chunks.push(chunk)) })
    await streamPipeline(c.query(copyStreams.to('COPY (SELECT id, note FROM sweep_state WHERE id >= 20 ORDER BY id) TO STDOUT')), sink)
    check('copy: COPY TO reads the rows', Buffer.concat(chunks).toString(), '20\tcopy-20\n21\tcopy-21\n')
  })
}

// node-postgres has no documented cancel API; Client#cancel(client, query) is the
// undocumented one it has kept since its early versions: an unconnected Client opens a
// plain socket of its own and sends the CancelRequest with the victim's key (pg 8.23
// itself then warns that Client.activeQuery, which it reads, is deprecated).
async function cancel() {
  await withClients([{}, {}, {}], async (victim, bystander, watcher) => {
    // The server's pid, not victim.processID: the door hands out cancel keys of its own.
    const pid = await scalar(victim, 'SELECT pg_backend_pid()')
    const beside = scalar(bystander, "SELECT 'unaffected' FROM pg_sleep(1.5)")
    const start = Date.now()
    const sleep = new Query('SELECT pg_sleep(10)')
    const slept = errorOf(new Promise((resolve, reject) => victim.query(sleep, (err, res) => (err ? reject(err) : resolve(res)))))
    const running = "SELECT count(*)::int FROM pg_stat_activity WHERE pid = $1 AND state = 'active'"
    while ((await scalar(watcher, running, [pid])) === 0) await new Promise((r) => setTimeout(r, 20))
    new Client({ connectionString: DSN }).cancel(victim, sleep)
    checkError('cancel: pg_sleep(10)', await slept, '57014')
    check('cancel: within 2 s', Date.now() - start < 2000, true)
    check('cancel: concurrent query on another connection', await beside, 'unaffected')
    check('cancel: connection usable', await scalar(victim, 'SELECT 1'), 1)
  })
}

async function listenNotify() {
  await withClients([{}, {}], async (listener, sender) => {
    const received = new Promise((resolve) => listener.once('notification', resolve))
    await listener.query('LISTEN fencegate_clients')
    await sender.query("SELECT pg_notify('fencegate_clients', 'from-sender')")
    const n = await received
    check('notify: delivered to the idle listener', [n.channel, n.payload], ['fencegate_clients', 'from-sender'])
  })
}

async function bytea() {
  await withClients([{}], async (c) => {
    check('bytea: 16 MiB round trip', digest(await scalar(c, 'SELECT $1::bytea', [BLOB])), digest(BLOB))
  })
}

const SCENARIOS = [seed, startupOptions, noToken, abortedTransaction, pipelined, multiStatement, copy, cancel, listenNotify, bytea]

async function main() {
  if (!DSN) {
    console.log('FAIL: FENCEGATE_CLIENT_DSN is not set')
    process.exit(1)
  }
  for (const scenario of SCENARIOS) {
    let timer
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`did not finish within ${SCENARIO_TIMEOUT_MS / 1000} s`)), SCENARIO_TIMEOUT_MS)
    })
    try {
      await Promise.race([scenario(), timeout])
    } catch (err) {
      // a server error by its message and SQLSTATE; anything else (a bug here) by its stack
      const what = err instanceof Mismatch ? err.message : err.code ? `${err.message} (code ${err.code})` : err.stack
      console.log(`FAIL ${scenario.name}: ${what}`)
      process.exit(1) // a stuck scenario may still hold sockets open
    } finally {
      clearTimeout(timer)
    }
  }
  console.log(`ok ${checks} checks`)
}

main()
