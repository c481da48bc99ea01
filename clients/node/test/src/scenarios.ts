/**
 * The replay harness's scenario files (`tests/scenarios/*.toml`), staged through this
 * package as a writer would use it.
 *
 * The Rust harness (`tests/src/replay`) puts a network hop, writer processes and a
 * database link around the gateway; here the same timelines run through the client's
 * public API against a real gateway:
 *
 * - `acquire` / `renew`: the gateway's hosted lease, one step at a time (`acquireLease`,
 *   `renewLease`), on the lease named after the scenario's resource.
 *   `lease.start_epoch` is where the Rust harness's lease table starts; here the
 *   resource's fence is advanced to it first, since a hosted lease's next token is above
 *   the fence's highest.
 * - `expire`: the seed's forced expiry. The current term is released on its holder's
 *   behalf, which the gateway judges as it does an expired lease (free for the next
 *   holder, `lease_lost` to a renewal), at once and whatever the TTL.
 * - `write` with `hold`, and writes of a `pause`d actor: prepared with the token the actor
 *   holds at that step, and sent at their `release` / `resume`: what the fence sees is the
 *   late arrival. `duplicate` sends the held write twice.
 * - `write` with `idempotency_key`: the client's own `idempotencyKey`, so a second step
 *   with the same key is a retry of the same write; `replayed` is the result's.
 * - `txn`: one `gateway.txn` of the step's `ops`, each with its own token, or its
 *   `actor`'s (else the step's) at that step; held, queued and released as a write is. A
 *   refusal's `presented` / `highest` are the first stale resource's.
 * - `restart_gateway` restarts the gateway process on its address and store; two
 *   `replicas` are two gateways on one Postgres database.
 *
 * Each step's `expect` is compared field by field with what the step observed; a field
 * the step did not observe fails, as in the Rust harness. Files that need what a client
 * cannot stage are listed in {@link NOT_REPLAYED}.
 */

import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';

import * as fencegate from 'fencegate';
import { parse } from 'smol-toml';

import { type GatewayProcess, REPO } from './harness.js';

export const SCENARIO_DIR = join(REPO, 'tests', 'scenarios');

/**
 * Scenario files these tests do not replay, each with why. A test keeps this equal to
 * the files that use an action the replayer cannot stage ({@link NOT_STAGED}).
 */
export const NOT_REPLAYED: Readonly<Record<string, string>> = {
  '11-database-outage': "cuts the gateway's connections to its database: a fault between gateway and store",
  '12-stale-flood': '10,000 held writes over 50 connections: a load test of the gateway, not of a client',
  '13-commit-reply-delayed': "holds the database's answers to the gateway: a fault between gateway and store",
  '14-keyed-retry': "holds the database's answers before a keyed retry: a fault between gateway and store",
  '16-etcd-pause': 'the lease lives in an etcd election the Rust harness starts: a lease source, not a client',
  '17-zookeeper-pause': 'the lease lives in a ZooKeeper election the Rust harness starts: a lease source, not a client',
};

/** Actions that need the Rust harness's network hop or database link. */
export const NOT_STAGED: ReadonlySet<string> = new Set([
  'drop',
  'reorder',
  'flood',
  'cut_database',
  'restore_database',
  'hold_database_replies',
  'release_database_replies',
]);

const TOP_FIELDS = new Set(['name', 'description', 'resource', 'lease', 'gateway', 'processes', 'control', 'step']);
const LEASE_FIELDS = new Set(['name', 'ttl', 'start_epoch', 'source']);
const STEP_FIELDS = new Set([
  'actor',
  'action',
  'label',
  'labels',
  'resource',
  'key',
  'value',
  'token',
  'hold',
  'delay',
  'duration',
  'if_match',
  'idempotency_key',
  'ops',
  'via',
  'series',
  'count',
  'connections',
  'meanwhile',
  'expect',
]);
const EXPECT_FIELDS = new Set([
  'outcome',
  'status',
  'presented',
  'highest',
  'version',
  'token',
  'value',
  'delta',
  'accepted',
  'duplicate',
  'applied',
  'replayed',
]);
const OP_FIELDS = new Set(['op', 'actor', 'resource', 'key', 'value', 'token']);

/** What a step observed, under the names of `expect`. */
export type Facts = Record<string, string | number | boolean | null>;

type Table = Record<string, unknown>;

// ---------------------------------------------------------------- the file

export class ScenarioError extends Error {}

export class Step {
  constructor(
    readonly number: number,
    readonly action: string,
    readonly fields: Readonly<Table>,
  ) {}

  has(name: string): boolean {
    return name in this.fields;
  }

  string(name: string, fallback?: string): string {
    const value = this.fields[name] ?? fallback;
    if (typeof value !== 'string') throw new ScenarioError(`step ${this.number} (${this.action}) needs \`${name}\``);
    return value;
  }

  integer(name: string, fallback: number): number {
    const value = this.fields[name] ?? fallback;
    if (typeof value !== 'number') throw new ScenarioError(`step ${this.number}: \`${name}\` is not a number`);
    return value;
  }

  get actor(): string {
    return this.string('actor');
  }

  get label(): string {
    return this.string('label');
  }

  get expect(): Table {
    return (this.fields['expect'] as Table | undefined) ?? {};
  }
}

export interface Scenario {
  readonly name: string;
  readonly resource: string;
  readonly ttlMs: number;
  readonly startEpoch: number;
  readonly replicas: number;
  readonly steps: readonly Step[];
  /** Where the lease lives: `postgres` (the default), `etcd` or `zookeeper`. */
  readonly source: string;
}

/**
 * What in a scenario the replayer cannot stage: a lease source other than the gateway's
 * own leases, and one entry per step.
 */
export function notStaged(scenario: Scenario): string[] {
  const source = scenario.source === 'postgres' ? [] : [`lease source ${scenario.source}`];
  return source.concat(
    scenario.steps
      .filter((s) => NOT_STAGED.has(s.action) || s.has('delay'))
      .map((s) => `step ${s.number}: ${s.action}${s.has('delay') ? ' with delay' : ''}`),
  );
}

function refuseUnknown(where: string, found: Table, known: ReadonlySet<string>): void {
  const extra = Object.keys(found).filter((name) => !known.has(name));
  if (extra.length > 0) throw new ScenarioError(`${where}: unknown fields ${extra.sort().join(', ')}`);
}

/** Milliseconds of a humantime duration such as `"1500ms"` or `"15s"`. */
export function durationMs(text: string): number {
  const units: Record<string, number> = { ms: 1, s: 1_000, m: 60_000, h: 3_600_000 };
  const parts = [...text.matchAll(/\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)/g)];
  if (parts.length === 0 || parts.map((p) => `${p[1]}${p[2]}`).join('') !== text.replace(/\s/g, '')) {
    throw new ScenarioError(`not a duration: ${JSON.stringify(text)}`);
  }
  return parts.reduce((total, p) => total + Number(p[1]) * (units[p[2] ?? ''] ?? 0), 0);
}

/**
 * Reads a scenario file, refusing fields the format does not have (as the Rust harness
 * does), so a typo fails here rather than being ignored.
 */
export function load(path: string): Scenario {
  const name = path.split('/').at(-1) ?? path;
  const data = parse(readFileSync(path, 'utf8')) as Table;
  refuseUnknown(name, data, TOP_FIELDS);
  const lease = (data['lease'] as Table | undefined) ?? {};
  refuseUnknown(`${name}: lease`, lease, LEASE_FIELDS);
  const steps = ((data['step'] as Table[] | undefined) ?? []).map((raw, index) => {
    refuseUnknown(`${name}: step ${index + 1}`, raw, STEP_FIELDS);
    refuseUnknown(`${name}: step ${index + 1}: expect`, (raw['expect'] as Table | undefined) ?? {}, EXPECT_FIELDS);
    for (const [op, fields] of ((raw['ops'] as Table[] | undefined) ?? []).entries()) {
      refuseUnknown(`${name}: step ${index + 1}: op ${op + 1}`, fields, OP_FIELDS);
    }
    return new Step(index + 1, String(raw['action']), raw);
  });
  if (steps.length === 0) throw new ScenarioError(`${name}: a scenario needs at least one [[step]]`);
  return {
    name: String(data['name']),
    resource: String(data['resource'] ?? 'orders'),
    ttlMs: durationMs(String(lease['ttl'] ?? '15s')),
    startEpoch: Number(lease['start_epoch'] ?? 0),
    replicas: Number((data['gateway'] as Table | undefined)?.['replicas'] ?? 1),
    steps,
    source: String(lease['source'] ?? 'postgres'),
  };
}

/** The scenario files, sorted. */
export function scenarioFiles(): string[] {
  return readdirSync(SCENARIO_DIR)
    .filter((file) => file.endsWith('.toml'))
    .sort()
    .map((file) => join(SCENARIO_DIR, file));
}

export function stem(path: string): string {
  return (path.split('/').at(-1) ?? path).replace(/\.toml$/, '');
}

// ---------------------------------------------------------------- the run

/** A write prepared at its step, with the token of that moment; sent later if held. */
interface Write {
  readonly kind: 'write';
  readonly label: string;
  readonly actor: string;
  readonly via: number;
  readonly resource: string;
  readonly key: string;
  readonly value: string;
  readonly token: bigint;
  readonly ifMatch: number | undefined;
  readonly idempotencyKey: string | undefined;
}

/** A transaction prepared at its step, with the tokens of that moment; sent later if held. */
interface Txn {
  readonly kind: 'txn';
  readonly label: string;
  readonly actor: string;
  readonly via: number;
  readonly operations: readonly fencegate.TxnOperation[];
  readonly idempotencyKey: string | undefined;
}

/** What a step sends, at once or at its release. */
type Request = Write | Txn;

type Answer = [Facts, string];

/** One run of a scenario against `gateways` (replica `n` is `gateways[n - 1]`). */
export class Replay {
  readonly timeline: string[] = [];
  readonly #clients = new Map<string, fencegate.Gateway>();
  readonly #tokens = new Map<string, bigint>();
  #term: { holder: string; token: bigint } | undefined;
  readonly #held = new Map<string, Request>();
  readonly #paused = new Map<string, Request[]>();
  readonly #answered = new Map<string, Answer>();
  readonly #baselines = new Map<string, number>();

  constructor(
    readonly scenario: Scenario,
    readonly gateways: readonly GatewayProcess[],
  ) {}

  /**
   * Runs every step and checks its `expect`; throws at the first step that differs, and
   * if a write is still in flight at the end.
   */
  async run(): Promise<string[]> {
    const scenario = this.scenario;
    const refused = notStaged(scenario);
    if (refused.length > 0) throw new ScenarioError(`${scenario.name} cannot be replayed here: ${refused.join(', ')}`);
    try {
      if (scenario.startEpoch > 0) await this.#client('-', 1).advance(scenario.resource, { token: scenario.startEpoch });
      for (const step of scenario.steps.filter((s) => s.action === 'metric')) {
        const series = this.#series(step);
        this.#baselines.set(series, await this.#metric(series));
      }
      for (const step of scenario.steps) {
        const [facts, text] = await this.#step(step);
        const actor = step.has('actor') ? step.actor : '-';
        const described = describeStep(step, scenario.resource);
        this.timeline.push(`#${String(step.number).padEnd(3)} ${actor.padEnd(8)} ${described} -> ${text}`);
        this.#check(step, facts);
      }
      const queued = [...this.#paused.values()].flat().map((write) => write.label);
      const left = [...this.#held.keys(), ...this.#answered.keys(), ...queued];
      if (left.length > 0) {
        throw new Error(`${scenario.name}: writes ${left.join(', ')} are still in flight at the end: release or await them`);
      }
      if (this.timeline.length !== scenario.steps.length) throw new Error(`${scenario.name}: not every step ran`);
      return this.timeline;
    } finally {
      for (const client of this.#clients.values()) client.close();
    }
  }

  #check(step: Step, facts: Facts): void {
    const expected: string[] = [];
    const observed: string[] = [];
    for (const [name, want] of Object.entries(step.expect)) {
      const got = facts[name];
      if (got === undefined || got === null || got !== want) {
        expected.push(`${name}=${String(want)}`);
        observed.push(`${name}=${got === undefined || got === null ? '-' : String(got)}`);
      }
    }
    if (expected.length > 0) {
      throw new Error(
        `${this.scenario.name}: step ${step.number} differs\n` +
          `  step:     ${this.timeline.at(-1) ?? ''}\n` +
          `  expected: ${expected.join(' ')}\n` +
          `  observed: ${observed.join(' ')}\n${this.timeline.join('\n')}`,
      );
    }
  }

  /** The actor's client of replica `via`: its name is the writes' `Fencing-Holder` and the lease holder. */
  #client(actor: string, via: number): fencegate.Gateway {
    const id = `${actor}@${via}`;
    let client = this.#clients.get(id);
    if (client === undefined) {
      const gateway = this.gateways[via - 1];
      if (gateway === undefined) throw new ScenarioError(`no gateway replica ${via}`);
      client = new fencegate.Gateway(gateway.url, { holder: actor, timeoutMs: 15_000 });
      this.#clients.set(id, client);
    }
    return client;
  }

  #via(step: Step): number {
    const via = step.integer('via', 1);
    if (via < 1 || via > this.gateways.length) {
      throw new ScenarioError(`step ${step.number}: \`via\` names a replica the scenario does not have`);
    }
    return via;
  }

  #resource(step: Step): string {
    return step.string('resource', this.scenario.resource);
  }

  #step(step: Step): Promise<Answer> {
    if (step.has('actor') && this.#paused.has(step.actor) && !['write', 'txn', 'resume'].includes(step.action)) {
      throw new ScenarioError(`step ${step.number}: ${step.actor} is paused and cannot ${step.action}`);
    }
    switch (step.action) {
      case 'acquire':
        return this.#acquire(step);
      case 'renew':
        return this.#renew(step);
      case 'expire':
        return this.#expire(step);
      case 'wait':
        return this.#wait(step);
      case 'write':
        return this.#write(step);
      case 'txn':
        return this.#txn(step);
      case 'advance':
        return this.#advance(step);
      case 'release':
        return this.#release(step);
      case 'await':
        return this.#await(step);
      case 'duplicate':
        return this.#duplicate(step);
      case 'pause':
        this.#paused.set(step.actor, []);
        return Promise.resolve([{}, 'paused']);
      case 'resume':
        return this.#resume(step);
      case 'restart_gateway':
        return this.#restart(step);
      case 'read':
        return this.#read(step);
      case 'fence':
        return this.#fence(step);
      case 'metric':
        return this.#metricStep(step);
      default:
        throw new ScenarioError(`step ${step.number}: no such action ${JSON.stringify(step.action)}`);
    }
  }

  // -- the lease

  async #acquire(step: Step): Promise<Answer> {
    const client = this.#client(step.actor, this.#via(step));
    let state: fencegate.LeaseState;
    try {
      state = await client.acquireLease(this.scenario.resource, { ttlMs: this.scenario.ttlMs });
    } catch (error) {
      if (error instanceof fencegate.LeaseHeld) return [{ outcome: 'refused' }, `refused: held by ${String(error.body['holder'])}`];
      throw error;
    }
    if (state.token === null) throw new Error('an acquired lease without a token');
    this.#tokens.set(step.actor, state.token);
    this.#term = { holder: step.actor, token: state.token };
    return [{ outcome: 'granted', token: Number(state.token) }, `granted token ${state.token}`];
  }

  async #renew(step: Step): Promise<Answer> {
    const token = this.#token(step);
    const client = this.#client(step.actor, this.#via(step));
    try {
      await client.renewLease(this.scenario.resource, { token, ttlMs: this.scenario.ttlMs });
    } catch (error) {
      if (error instanceof fencegate.LeaseLost) {
        return [{ outcome: 'refused', token: Number(token) }, `refused: token ${token} was replaced`];
      }
      throw error;
    }
    return [{ outcome: 'granted', token: Number(token) }, `granted: renewed at token ${token}`];
  }

  async #expire(step: Step): Promise<Answer> {
    const term = this.#term;
    if (term === undefined) throw new ScenarioError(`step ${step.number}: nobody holds the lease`);
    await this.#client(term.holder, 1).releaseLease(this.scenario.resource, { token: term.token });
    this.#term = undefined;
    return [{}, `term of token ${term.token} ended (${term.holder} not told)`];
  }

  async #wait(step: Step): Promise<Answer> {
    const ms = durationMs(step.string('duration'));
    await sleep(ms);
    return [{}, `waited ${ms} ms`];
  }

  #token(step: Step): bigint {
    if (step.has('token')) return BigInt(step.integer('token', 0));
    const token = this.#tokens.get(step.actor);
    if (token === undefined) throw new ScenarioError(`step ${step.number}: ${step.actor} holds no token`);
    return token;
  }

  // -- writes

  async #write(step: Step): Promise<Answer> {
    const ifMatch = step.has('if_match') ? Number(step.string('if_match')) : undefined;
    if (ifMatch !== undefined && !Number.isSafeInteger(ifMatch)) throw new ScenarioError(`step ${step.number}: bad if_match`);
    const write: Write = {
      kind: 'write',
      label: step.string('label', `step-${step.number}`),
      actor: step.string('actor', '-'),
      via: this.#via(step),
      resource: this.#resource(step),
      key: step.string('key', 'k'),
      value: step.string('value'),
      token: this.#token(step),
      ifMatch,
      idempotencyKey: idempotencyKey(step),
    };
    return this.#dispatch(step, write);
  }

  async #txn(step: Step): Promise<Answer> {
    const ops = (step.fields['ops'] as Table[] | undefined) ?? [];
    if (ops.length === 0) throw new ScenarioError(`step ${step.number} (txn) needs \`ops\``);
    const txn: Txn = {
      kind: 'txn',
      label: step.string('label', `step-${step.number}`),
      actor: step.string('actor', '-'),
      via: this.#via(step),
      operations: ops.map((op, index) => this.#operation(step, index + 1, op)),
      idempotencyKey: idempotencyKey(step),
    };
    return this.#dispatch(step, txn);
  }

  /** One of a `txn` step's `ops`, with the token its actor holds now. */
  #operation(step: Step, index: number, op: Table): fencegate.TxnOperation {
    const where = `step ${step.number}: op ${index}`;
    const resource = String(op['resource'] ?? this.scenario.resource);
    const key = String(op['key'] ?? 'k');
    let token: bigint | undefined;
    if (op['token'] !== undefined) {
      token = BigInt(op['token'] as number | bigint);
    } else {
      const actor = op['actor'] ?? step.fields['actor'];
      token = typeof actor === 'string' ? this.#tokens.get(actor) : undefined;
      if (token === undefined) throw new ScenarioError(`${where} needs \`token\`, or an actor that holds one`);
    }
    switch (op['op']) {
      case 'put':
        if (op['value'] === undefined) throw new ScenarioError(`${where} (put) needs \`value\``);
        return { op: 'put', resource, key, value: String(op['value']), token };
      case 'delete':
        return { op: 'delete', resource, key, token };
      case 'advance':
        return { op: 'advance', resource, token };
      case 'check':
        return { op: 'check', resource, token };
      default:
        throw new ScenarioError(`${where} is ${JSON.stringify(op['op'])}, not put, delete, advance or check`);
    }
  }

  /** Sends a prepared write or transaction now, or keeps it for its writer's `resume` or its `release`. */
  #dispatch(step: Step, request: Request): Promise<Answer> {
    const queue = this.#paused.get(request.actor);
    if (queue !== undefined) {
      queue.push(request);
      return Promise.resolve([{}, 'queued in the paused writer (pending)']);
    }
    if (step.fields['hold'] === true) {
      this.#held.set(request.label, request);
      return Promise.resolve([{}, 'held in the network (pending)']);
    }
    return this.#send(request);
  }

  async #send(request: Request): Promise<Answer> {
    const client = this.#client(request.actor, request.via);
    try {
      if (request.kind === 'txn') {
        return committed(await client.txn(request.operations, { idempotencyKey: request.idempotencyKey }));
      }
      const result = await client.put(request.resource, request.key, request.value, {
        token: request.token,
        ifMatch: request.ifMatch,
        idempotencyKey: request.idempotencyKey,
      });
      const status = result.created ? 201 : 200;
      const facts = {
        outcome: 'accepted',
        status,
        token: Number(result.token),
        version: result.version,
        replayed: result.replayed,
      };
      const text = `accepted ${status} token=${result.token} version=${result.version}`;
      return [facts, result.replayed ? `${text} (replayed)` : text];
    } catch (error) {
      return refusal(error);
    }
  }

  async #advance(step: Step): Promise<Answer> {
    const token = this.#token(step);
    let state: fencegate.FenceState;
    try {
      state = await this.#client(step.actor, this.#via(step)).advance(this.#resource(step), { token });
    } catch (error) {
      return refusal(error);
    }
    const highest = state.highest === null ? null : Number(state.highest);
    return [{ outcome: 'accepted', highest }, `accepted highest=${highest}`];
  }

  async #release(step: Step): Promise<Answer> {
    const labels = step.has('label') ? [step.label] : ((step.fields['labels'] as string[] | undefined) ?? []);
    const writes = labels.map((label) => this.#takeHeld(step, label));
    const [only] = writes;
    if (writes.length === 1 && only !== undefined) return this.#send(only);
    // Released at once: the writes race at the gateway.
    const answers = await Promise.all(writes.map((write) => this.#send(write)));
    const accepted = answers.filter(([facts]) => facts['outcome'] === 'accepted').length;
    return [{ accepted }, `${accepted} of ${writes.length} accepted: ${answers.map(([, text]) => text).join('; ')}`];
  }

  #takeHeld(step: Step, label: string): Request {
    const request = this.#held.get(label);
    if (request === undefined) throw new ScenarioError(`step ${step.number}: nothing held is labelled ${label}`);
    this.#held.delete(label);
    return request;
  }

  async #duplicate(step: Step): Promise<Answer> {
    const write = this.#takeHeld(step, step.label);
    const [facts, text] = await this.#send(write);
    const [copy, copyText] = await this.#send(write);
    return [{ ...facts, duplicate: copy['outcome'] ?? null }, `${text}; copy: ${copyText}`];
  }

  async #resume(step: Step): Promise<Answer> {
    const queued = this.#paused.get(step.actor);
    if (queued === undefined) throw new ScenarioError(`step ${step.number}: ${step.actor} is not paused`);
    this.#paused.delete(step.actor);
    for (const request of queued) this.#answered.set(request.label, await this.#send(request));
    return [{}, `running; ${queued.length} queued writes sent`];
  }

  #await(step: Step): Promise<Answer> {
    const answer = this.#answered.get(step.label);
    if (answer === undefined) {
      throw new ScenarioError(`step ${step.number}: write ${step.label} was not sent: resume its writer first`);
    }
    this.#answered.delete(step.label);
    return Promise.resolve(answer);
  }

  // -- the gateway

  async #restart(step: Step): Promise<Answer> {
    await this.gateways[this.#via(step) - 1]?.restart();
    return [{}, 'restarted, ready'];
  }

  async #read(step: Step): Promise<Answer> {
    const stored = await this.#client('-', this.#via(step)).get(this.#resource(step), step.string('key', 'k'));
    if (stored === null) return [{ outcome: 'absent' }, 'absent'];
    const facts = {
      outcome: 'accepted',
      status: 200,
      value: stored.text(),
      version: stored.version,
      token: Number(stored.token),
    };
    return [facts, `${JSON.stringify(stored.text())} token=${stored.token} version=${stored.version}`];
  }

  async #fence(step: Step): Promise<Answer> {
    const { highest } = await this.#client('-', this.#via(step)).fence(this.#resource(step));
    return [{ highest: highest === null ? null : Number(highest) }, `highest=${highest}`];
  }

  #series(step: Step): string {
    return step.string('series').replaceAll('{resource}', this.scenario.resource);
  }

  /** The series summed over the replicas (0 where it is absent). */
  async #metric(series: string): Promise<number> {
    let total = 0;
    for (const gateway of this.gateways) {
      const text = await (await fetch(`${gateway.url}/metrics`)).text();
      for (const line of text.split('\n')) {
        if (line.startsWith(`${series} `)) total += Number(line.split(' ').at(-1));
      }
    }
    return total;
  }

  async #metricStep(step: Step): Promise<Answer> {
    const series = this.#series(step);
    const delta = (await this.#metric(series)) - (this.#baselines.get(series) ?? 0);
    return [{ delta }, `${series} rose by ${delta}`];
  }
}

function idempotencyKey(step: Step): string | undefined {
  return step.has('idempotency_key') ? step.string('idempotency_key') : undefined;
}

function committed(outcome: fencegate.TxnOutcome): Answer {
  const text = `accepted 200, ${outcome.results.length} operations applied`;
  return [{ outcome: 'accepted', status: 200, replayed: outcome.replayed }, outcome.replayed ? `${text} (replayed)` : text];
}

/**
 * A write's, a transaction's or an advance's refusal as facts (of a transaction: the
 * first stale resource's tokens, as the answer's top-level fields give them); any other
 * error is the harness's.
 */
function refusal(error: unknown): Answer {
  if (error instanceof fencegate.StaleToken) {
    const facts = {
      outcome: 'rejected',
      status: error.status ?? null,
      presented: Number(error.presented),
      highest: Number(error.highest),
    };
    return [facts, `rejected ${error.status} presented=${error.presented} highest=${error.highest}`];
  }
  if (error instanceof fencegate.VersionMismatch) {
    return [{ outcome: 'precondition_failed', status: error.status ?? null }, `412 current=${error.current}`];
  }
  if (error instanceof fencegate.BackendUnavailable) {
    const applied = error.writeApplied === null ? 'unknown' : error.writeApplied ? 'yes' : 'no';
    return [{ outcome: 'unavailable', status: error.status ?? null, applied }, `unavailable ${applied}`];
  }
  throw error;
}

function describeStep(step: Step, resource: string): string {
  const parts = [step.action, ...((step.fields['labels'] as string[] | undefined) ?? [])];
  for (const name of ['label', 'resource', 'key', 'value']) {
    if (step.has(name)) parts.push(String(step.fields[name]));
  }
  if (step.has('token')) parts.push(`token=${String(step.fields['token'])}`);
  for (const op of (step.fields['ops'] as Table[] | undefined) ?? []) {
    let target = String(op['resource'] ?? resource);
    if (op['op'] === 'put' || op['op'] === 'delete') target += `/${String(op['key'] ?? 'k')}`;
    parts.push(`[${String(op['op'])} ${target}]`);
  }
  if (step.has('idempotency_key')) parts.push(`idempotency-key=${String(step.fields['idempotency_key'])}`);
  if (step.fields['hold'] === true) parts.push('(held)');
  if (step.has('via')) parts.push(`via gateway ${String(step.fields['via'])}`);
  return parts.join(' ');
}
