/** The example sweeper from the installed package, run as a process: a real pause (SIGSTOP). */

import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { createInterface } from 'node:readline';
import { test } from 'node:test';

import * as fencegate from 'fencegate';

import { defer, gatewayOn } from './harness.js';

const SWEEPER = join(
  dirname(createRequire(import.meta.url).resolve('fencegate/package.json')),
  'examples',
  'sweeper',
  'sweeper.mjs',
);

/** The example program, its output read line by line. */
class Sweeper {
  readonly child: ChildProcess;
  readonly seen: string[] = [];
  readonly #waiting: { pattern: RegExp; found: (match: RegExpMatchArray) => void }[] = [];
  #unread: string[] = [];

  constructor(url: string, node: string, ttlMs: number) {
    this.child = spawn(
      process.execPath,
      [SWEEPER, '--gateway', url, '--node', node, '--lease', 'sweeper', '--ttl-ms', String(ttlMs),
        '--interval-ms', '50', '--invoices', '2'],
      { stdio: ['ignore', 'pipe', 'inherit'] },
    );
    createInterface({ input: this.child.stdout! }).on('line', (line) => {
      this.seen.push(line);
      this.#unread.push(line);
      this.#match();
    });
  }

  /** The next line matching `pattern`, skipping the ones before it. */
  expect(pattern: RegExp, timeoutMs = 10_000): Promise<RegExpMatchArray> {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`never printed ${pattern}; printed ${this.seen.join(' | ')}`)), timeoutMs);
      this.#waiting.push({
        pattern,
        found: (match) => {
          clearTimeout(timer);
          resolve(match);
        },
      });
      this.#match();
    });
  }

  #match(): void {
    const waiter = this.#waiting[0];
    if (waiter === undefined) return;
    while (this.#unread.length > 0) {
      const match = this.#unread.shift()!.match(waiter.pattern);
      if (match) {
        this.#waiting.shift();
        waiter.found(match);
        return;
      }
    }
  }

  signal(name: NodeJS.Signals): void {
    this.child.kill(name);
  }

  async stop(): Promise<number | null> {
    const exited = new Promise<number | null>((done) => this.child.once('exit', (code) => done(code)));
    this.child.kill('SIGCONT');
    this.child.kill('SIGTERM');
    return exited;
  }
}

test('a paused sweeper stops on waking, and its writes never land after the takeover', async (t) => {
  const ttlMs = 1_000;
  const gatewayProcess = await gatewayOn(t, 'embedded');
  const a = new Sweeper(gatewayProcess.url, 'node-a', ttlMs);
  try {
    const tokenA = BigInt((await a.expect(/node-a: leading with token (\d+)/))[1]!);
    await a.expect(/invoice-002\/reminder written with token/);
    a.signal('SIGSTOP'); // a long GC pause, a VM migration

    const gateway = new fencegate.Gateway(gatewayProcess.url, { holder: 'node-b' });
    defer(t, () => gateway.close());
    const b = gateway.lease('sweeper', { ttlMs });
    assert.ok(await b.acquire({ timeoutMs: 5_000 }));
    assert.equal(b.token, tokenA + 1n);
    const written = await b.put('invoice-001/reminder', 'reminder sent by node-b');
    a.signal('SIGCONT');
    const over = await a.expect(/node-a: term of token (\d+) over: (\w+)/);
    assert.equal(BigInt(over[1]!), tokenA);
    assert.ok(['deadline', 'stale_token'].includes(over[2]!), over[2]);
    await a.expect(/node-a: waiting for the lease/);
    const stored = await gateway.get('sweeper', 'invoice-001/reminder');
    assert.deepEqual(
      [stored?.text(), stored?.version, stored?.token],
      ['reminder sent by node-b', written.version, b.token],
      'node-a wrote after node-b took over',
    );
    assert.ok(b.held);
    await b.release();
    // node-b released: node-a takes over at once with the next token.
    assert.equal(BigInt((await a.expect(/node-a: leading with token (\d+)/))[1]!), b.token + 1n);
  } finally {
    assert.equal(await a.stop(), 0);
  }
});
