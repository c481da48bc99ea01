// Type-checks a Grafana dashboard JSON file against the `Dashboard` type of
// @grafana/schema, the types Grafana's own frontend is written against.
//
// The JSON is wrapped as `export const d = (<json>) satisfies Dashboard;` and given to
// `tsc --noEmit --strict`. `satisfies` keeps the object literal "fresh", so TypeScript
// reports keys the type does not know (a misspelt `titel`) as well as wrong types.
//
// Usage: node check.mjs [dashboard.json]   (default: ../fencegate.json)
// Exit status: 0 if the dashboard type-checks, 1 (with tsc's messages) if not.

import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const input = resolve(process.argv[2] ?? join(here, '..', 'fencegate.json'));
const json = readFileSync(input, 'utf8');
JSON.parse(json); // a syntax error is reported as such, not as a TypeScript error

// The generated file lives inside this project so that `@grafana/schema` resolves
// from its node_modules; a fresh directory per run lets checks run side by side.
const work = mkdtempSync(join(here, 'generated-'));
const source = join(work, 'dashboard.ts');
writeFileSync(
  source,
  `import type { Dashboard } from '@grafana/schema';\n\nexport const d = (${json}) satisfies Dashboard;\n`,
);
const tsc = spawnSync(
  process.execPath,
  [
    join(here, 'node_modules', 'typescript', 'bin', 'tsc'),
    '--noEmit',
    '--strict',
    '--target', 'es2022',
    '--module', 'esnext',
    '--moduleResolution', 'bundler',
    // Only our file is under test; the package's own declarations are Grafana's.
    '--skipLibCheck',
    '--pretty', 'false',
    source,
  ],
  { encoding: 'utf8' },
);
rmSync(work, { recursive: true, force: true });
process.stdout.write(tsc.stdout ?? '');
process.stderr.write(tsc.stderr ?? '');
if (tsc.error) throw tsc.error;
if (tsc.status === 0) console.log(`${input}: satisfies Dashboard`);
process.exit(tsc.status === 0 ? 0 : 1);
