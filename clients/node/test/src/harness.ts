/**
 * Real things for the tests to run against: the gateway binary, a TCP hop that can hold
 * what a client sends, and the one place that sets up databases. No fixed ports.
 */

import { type ChildProcess, execFile, spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import type { TestContext } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

import pg from 'pg';

/** The root of the fencegate workspace (this file runs from clients/node/test/build). */
export const REPO = resolve(fileURLToPath(new URL('.', import.meta.url)), '../../../..');

/** The gateway binary under test. */
export const BINARY = process.env['FENCEGATE_BIN'] ?? join(REPO, 'target', 'debug', 'fencegate');

const PG_HOST = process.env['PGHOST'] ?? '127.0.0.1';
const PG_PORT = process.env['PGPORT'] ?? '5432';

export const run = promisify(execFile);

/** The superuser's URL of a database. */
export function adminUrl(database = 'postgres'): string {
  return `postgresql://postgres@${PG_HOST}:${PG_PORT}/${database}`;
}

async function superuser<T>(database: string, work: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: adminUrl(database), connectionTimeoutMillis: 5_000 });
  await client.connect();
  try {
    return await work(client);
  } finally {
    await client.end();
  }
}

// Every test file imports this module: without Postgres, each fails here, loudly.
try {
  await superuser('postgres', (client) => client.query('SELECT 1'));
} catch (error) {
  throw new Error(`Postgres at ${PG_HOST}:${PG_PORT} (user postgres, trust) is not reachable: ${String(error)}`);
}

const cleanups = new WeakMap<TestContext, (() => unknown)[]>();

/**
 * Runs `cleanup` when the test ends, after the cleanups deferred later (last in, first
 * out, as resources are torn down in the reverse order of their making: clients, then
 * gateways, then databases). Every cleanup runs; the first error is reported.
 */
export function defer(t: TestContext, cleanup: () => unknown): void {
  let stack = cleanups.get(t);
  if (stack === undefined) {
    const created: (() => unknown)[] = [];
    stack = created;
    cleanups.set(t, created);
    t.after(async () => {
      let first: unknown;
      for (const run of created.reverse()) {
        try {
          await run();
        } catch (error) {
          first ??= error;
        }
      }
      if (first !== undefined) throw first;
    });
  }
  stack.push(cleanup);
}

/** The first truthy value of `probe()`, polled until `timeoutMs`; throws if none. */
export async function eventually<T>(probe: () => T | Promise<T>, timeoutMs = 5_000): Promise<T> {
  const giveUp = Date.now() + timeoutMs;
  for (;;) {
    const value = await probe();
    if (value) return value;
    if (Date.now() > giveUp) throw new Error(`not true within ${timeoutMs} ms: ${probe.toString()}`);
    await sleep(10);
  }
}

// ---------------------------------------------------------------- databases

/**
 * A fresh database with table `sweep_state` (row `1, 'initial'`) fenced under resource
 * `sweeper`; a login role `writer` that may write it and present the resource's tokens
 * (through the door, or straight to Postgres); and a login role `sqlLogin` that may
 * write it and nothing of fencegate's, for the statements of `/v1/sql`.
 */
export interface FencedDatabase {
  readonly name: string;
  readonly writer: string;
  readonly sqlLogin: string;
  readonly adminUrl: string;
  /** The writer's URL, straight to Postgres or (`addr`) through the door. */
  writerUrl(addr?: string): string;
  /** The URL of `/v1/sql`'s login (`--sql-database-url`). */
  readonly sqlUrl: string;
  /** Row 1's note, read as the superuser. */
  note(): Promise<string>;
}

/**
 * All database setup of these tests, in one place: the database, the fenced table, the
 * writer's role and its grants. The rights a role needs to fence a resource are granted
 * here and nowhere else. Dropped when the test ends.
 */
export async function fencedDatabase(t: TestContext): Promise<FencedDatabase> {
  const suffix = Math.random().toString(16).slice(2, 14).padEnd(12, '0');
  const name = `fg_node_${suffix}`;
  const writer = `${name}_writer`;
  const sqlLogin = `${name}_sql`;
  const roles = [writer, sqlLogin];
  const url = adminUrl(name);
  defer(t, () =>
    superuser('postgres', async (client) => {
      await client.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
      for (const role of roles) await client.query(`DROP ROLE IF EXISTS ${role}`);
    }),
  );
  await superuser('postgres', async (client) => {
    await client.query(`CREATE DATABASE ${name}`);
    for (const role of roles) await client.query(`CREATE ROLE ${role} LOGIN`);
  });
  await superuser(name, async (client) => {
    await client.query('CREATE TABLE sweep_state (id int PRIMARY KEY, note text NOT NULL)');
    await client.query("INSERT INTO sweep_state VALUES (1, 'initial')");
  });
  await run(BINARY, ['protect', 'sweep_state', '--resource', 'sweeper', '--database-url', url], {
    env: { PATH: process.env['PATH'] ?? '' },
  });
  await superuser(name, async (client) => {
    for (const role of roles) {
      await client.query(`GRANT USAGE ON SCHEMA public TO ${role}`);
      await client.query(`GRANT SELECT, INSERT, UPDATE, DELETE ON sweep_state TO ${role}`);
    }
  });
  // The writer's right to present and raise the fence of the resource, and of no other.
  // (The gateway gives /v1/sql's login what that needs itself.)
  await run(BINARY, ['grant', writer, '--resource', 'sweeper', '--database-url', url], {
    env: { PATH: process.env['PATH'] ?? '' },
  });
  return {
    name,
    writer,
    sqlLogin,
    adminUrl: url,
    writerUrl: (addr = `${PG_HOST}:${PG_PORT}`) => `postgresql://${writer}@${addr}/${name}`,
    sqlUrl: `postgresql://${sqlLogin}@${PG_HOST}:${PG_PORT}/${name}`,
    note: () =>
      superuser(name, async (client) => {
        const result = await client.query<{ note: string }>('SELECT note FROM sweep_state WHERE id = 1');
        return result.rows[0]?.note ?? '';
      }),
  };
}

/** Drops a database now (the gateway's backend going away). */
export function dropDatabase(name: string): Promise<unknown> {
  return superuser('postgres', (client) => client.query(`DROP DATABASE ${name} WITH (FORCE)`));
}

// ---------------------------------------------------------------- gateways

/** The `fencegate` binary on a free port, its JSON log kept. */
export class GatewayProcess {
  readonly args: string[];
  readonly scheme: string;
  addr = '';
  pgAddr: string | undefined;
  readonly logs: string[] = [];
  #child: ChildProcess | undefined;
  #exited: Promise<void> = Promise.resolve();

  constructor(args: string[], scheme = 'http') {
    this.args = args;
    this.scheme = scheme;
  }

  get url(): string {
    return `${this.scheme}://${this.addr}`;
  }

  get pid(): number {
    const pid = this.#child?.pid;
    if (pid === undefined) throw new Error('the gateway is not running');
    return pid;
  }

  async start(listen = '127.0.0.1:0'): Promise<this> {
    const args = ['--listen', listen, '--log-format', 'json', ...this.args];
    if (this.args.includes('--database-url') && !this.args.includes('--pg-listen')) args.push('--pg-listen', '127.0.0.1:0');
    // Only what is passed here configures the gateway.
    const child = spawn(BINARY, args, {
      env: { PATH: process.env['PATH'] ?? '', RUST_BACKTRACE: '1' },
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    this.#child = child;
    this.#exited = new Promise((done) => child.once('exit', () => done()));
    const lines = createInterface({ input: child.stderr! });
    const ready = new Promise<boolean>((done) => {
      lines.on('line', (line) => {
        this.logs.push(line);
        try {
          const fields = (JSON.parse(line) as { fields?: Record<string, string> }).fields;
          if (fields?.['message'] === 'fencegate ready') {
            this.addr = fields['addr'] ?? '';
            this.pgAddr = fields['pg_addr'];
            done(true);
          }
        } catch {
          // not JSON: a panic message, kept in the logs
        }
      });
      lines.on('close', () => done(false));
    });
    const timeout = sleep(30_000, false, { ref: false });
    if (!(await Promise.race([ready, timeout]))) {
      this.kill();
      throw new Error(`the gateway did not start: ${args.join(' ')}\n${this.logs.join('\n')}`);
    }
    return this;
  }

  /** Stops the gateway and starts it again on the same address and store. */
  async restart(): Promise<this> {
    await this.stop();
    return this.start(this.addr);
  }

  /** SIGTERM, and SIGKILL if it has not exited within 10 s. */
  async stop(): Promise<void> {
    const child = this.#child;
    if (child === undefined || child.exitCode !== null || child.signalCode !== null) return;
    child.kill('SIGCONT'); // a paused process cannot exit
    child.kill('SIGTERM');
    const stopped = await Promise.race([this.#exited.then(() => true), sleep(10_000, false, { ref: false })]);
    if (!stopped) this.kill();
    await this.#exited;
  }

  /** SIGKILL: the gateway dies at once, as on a crash. */
  kill(): Promise<void> {
    const child = this.#child;
    if (child !== undefined && child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    return this.#exited;
  }

  /** SIGSTOP: connections are accepted by the kernel, nothing is answered. */
  pause(): void {
    process.kill(this.pid, 'SIGSTOP');
  }

  resume(): void {
    process.kill(this.pid, 'SIGCONT');
  }
}

/** The two backends every API test runs on. */
export const BACKENDS = ['embedded', 'postgres'] as const;
export type Backend = (typeof BACKENDS)[number];

/** The flags of a backend: a fresh data directory, or a fresh fenced database. */
export async function backendArgs(t: TestContext, backend: Backend): Promise<{ args: string[]; db?: FencedDatabase }> {
  if (backend === 'postgres') {
    const db = await fencedDatabase(t);
    return { args: ['--database-url', db.adminUrl], db };
  }
  const dir = mkdtempSync(join(tmpdir(), 'fencegate-node-'));
  defer(t, () => rmSync(dir, { recursive: true, force: true }));
  return { args: ['--data-dir', dir] };
}

/** Starts a gateway for the test, stopped when it ends. */
export async function startGateway(t: TestContext, args: string[], scheme = 'http'): Promise<GatewayProcess> {
  const gateway = new GatewayProcess(args, scheme);
  defer(t, () => gateway.stop());
  return gateway.start();
}

/** A gateway on `backend`, stopped when the test ends. */
export async function gatewayOn(t: TestContext, backend: Backend, ...extra: string[]): Promise<GatewayProcess> {
  const { args } = await backendArgs(t, backend);
  return startGateway(t, [...args, ...extra]);
}

// ---------------------------------------------------------------- the network

/**
 * A TCP hop in front of `target` that records what clients send and can hold it:
 * `hold()` keeps every byte sent from then on until `release()`, as a network that
 * delays packets. `loseAnswers(n)` drops the next `n` answers and cuts their
 * connections: the gateway has done the request, the client never hears of it.
 * `sentAt(marker)` says when requests were sent.
 */
export class Hop {
  readonly #target: { host: string; port: number };
  readonly #server: net.Server;
  readonly #sockets = new Set<net.Socket>();
  #held = false;
  #waiting: (() => void)[] = [];
  #sent: Buffer[] = [];
  #sentAt: number[] = [];
  #losing = 0;
  /** Answers dropped so far. */
  lost = 0;
  addr = '';

  private constructor(target: string) {
    const at = target.lastIndexOf(':');
    this.#target = { host: target.slice(0, at), port: Number(target.slice(at + 1)) };
    this.#server = net.createServer((client) => this.#connect(client));
  }

  static async open(t: TestContext, target: string): Promise<Hop> {
    const hop = new Hop(target);
    await new Promise<void>((done) => hop.#server.listen(0, '127.0.0.1', done));
    hop.addr = `127.0.0.1:${(hop.#server.address() as net.AddressInfo).port}`;
    defer(t, () => hop.close());
    return hop;
  }

  get url(): string {
    return `http://${this.addr}`;
  }

  /** Everything clients sent through the hop so far. */
  sent(): Buffer {
    return Buffer.concat(this.#sent);
  }

  /**
   * When (`performance.now()`) the hop read each chunk a client sent that holds
   * `marker`, such as a request line: one per request, in order.
   */
  sentAt(marker: string): number[] {
    return this.#sent.flatMap((chunk, index) => (chunk.includes(marker) ? [this.#sentAt[index]!] : []));
  }

  /** Drops the next `count` answers, cutting the connection each came on. */
  loseAnswers(count: number): void {
    this.#losing = count;
  }

  hold(): void {
    this.#held = true;
  }

  release(): void {
    this.#held = false;
    for (const resume of this.#waiting.splice(0)) resume();
  }

  close(): void {
    this.release();
    for (const socket of this.#sockets) socket.destroy();
    this.#server.close();
  }

  #connect(client: net.Socket): void {
    const upstream = net.connect(this.#target);
    this.#sockets.add(client).add(upstream);
    // Bytes from the client queue up, in order, while the hop holds them.
    let queue = Promise.resolve();
    client.on('data', (chunk: Buffer) => {
      this.#sent.push(chunk);
      this.#sentAt.push(performance.now());
      queue = queue.then(async () => {
        if (this.#held) await new Promise<void>((resume) => this.#waiting.push(resume));
        upstream.write(chunk);
      });
    });
    client.on('end', () => void queue.then(() => upstream.end()));
    upstream.on('data', (chunk: Buffer) => {
      if (this.#losing > 0) {
        this.#losing -= 1;
        this.lost += 1;
        client.destroy();
        upstream.destroy();
        return;
      }
      client.write(chunk);
    });
    upstream.on('end', () => client.end());
    for (const socket of [client, upstream]) socket.on('error', () => socket.destroy());
    client.on('close', () => void queue.then(() => upstream.destroy()));
  }
}

/** A port nothing listens on. */
export async function closedPort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((done) => server.listen(0, '127.0.0.1', done));
  const port = (server.address() as net.AddressInfo).port;
  await new Promise((done) => server.close(done));
  return port;
}

// ---------------------------------------------------------------- a scripted gateway

/** A scripted answer: status, JSON fields, headers. */
export type ScriptedAnswer = readonly [number, Record<string, unknown>, Record<string, string>?];

/** A scripted answer that reads the request, answers nothing and closes the connection. */
export const CUT = 'cut';

/**
 * An HTTP server that answers each request with the next answer of a script, and keeps
 * every request's headers, to check what a client sent on each attempt. A request past
 * the end of the script is answered `500`; `assertDone()` fails unless the whole script
 * was consumed. Closed when the test ends.
 */
export class ScriptedGateway {
  readonly requests: http.IncomingHttpHeaders[] = [];
  readonly #script: (ScriptedAnswer | typeof CUT)[];
  readonly #server: http.Server;
  url = '';

  private constructor(script: (ScriptedAnswer | typeof CUT)[]) {
    this.#script = script;
    this.#server = http.createServer((request, response) => {
      request.resume();
      request.on('end', () => {
        this.requests.push(request.headers);
        const step = this.#script.shift() ?? ([500, { error: 'internal' }] as const);
        if (step === CUT) {
          request.socket.destroy();
          return;
        }
        const [status, body, headers = {}] = step;
        const payload = JSON.stringify({ message: 'scripted', ...body });
        response.writeHead(status, { 'content-type': 'application/json', ...headers });
        response.end(payload);
      });
    });
  }

  static async start(t: TestContext, ...script: (ScriptedAnswer | typeof CUT)[]): Promise<ScriptedGateway> {
    const server = new ScriptedGateway(script);
    await new Promise<void>((done) => server.#server.listen(0, '127.0.0.1', done));
    server.url = `http://127.0.0.1:${(server.#server.address() as net.AddressInfo).port}`;
    defer(t, () => {
      server.#server.closeAllConnections();
      return new Promise((done) => server.#server.close(done));
    });
    return server;
  }

  /** The `Idempotency-Key` of every request so far. */
  keys(): (string | undefined)[] {
    return this.requests.map((headers) => {
      const key = headers['idempotency-key'];
      return Array.isArray(key) ? key[0] : key;
    });
  }

  assertDone(): void {
    if (this.#script.length > 0) throw new Error(`the script was not consumed: ${JSON.stringify(this.#script)}`);
  }
}
