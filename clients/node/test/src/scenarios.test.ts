/**
 * The Rust replay harness's scenario files, replayed through the client against a real
 * gateway: on the embedded store, or two replicas on one Postgres database where the
 * scenario has two.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { backendArgs, startGateway } from './harness.js';
import { load, NOT_REPLAYED, notStaged, Replay, scenarioFiles, stem } from './scenarios.js';

test('every scenario file is replayed or listed with a reason', () => {
  const files = new Map(scenarioFiles().map((path) => [stem(path), load(path)]));
  assert.ok(files.size >= 10, `the scenario files were not found: ${[...files.keys()].join(', ')}`);
  for (const [name, scenario] of files) assert.equal(scenario.name, name, `${name}.toml is named ${scenario.name}`);
  // Exactly the files that need what a client cannot stage: a new file is replayed unless
  // it is listed, and a listing cannot hide a file the replayer could run.
  const notStagedNames = [...files].filter(([, scenario]) => notStaged(scenario).length > 0).map(([name]) => name);
  assert.deepEqual(Object.keys(NOT_REPLAYED).sort(), notStagedNames.sort());
});

for (const path of scenarioFiles().filter((path) => !(stem(path) in NOT_REPLAYED))) {
  test(`scenario ${stem(path)}`, async (t) => {
    const scenario = load(path);
    const { args } = await backendArgs(t, scenario.replicas > 1 ? 'postgres' : 'embedded');
    const gateways = [];
    for (let replica = 0; replica < scenario.replicas; replica += 1) gateways.push(await startGateway(t, args));
    // Throws at the first step that differs, with the timeline up to it.
    await new Replay(scenario, gateways).run();
  });
}
