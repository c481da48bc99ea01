// Builds dist/ with TypeScript: `npm run build`, and npm's `prepare` (run by `npm pack`,
// `npm publish`, and when this directory or a git URL is installed as a dependency).
//
// npm installs a git dependency's devDependencies before its `prepare`, but not those of
// a directory dependency (`npm install ./clients/node` links the directory as it is), nor
// of a fresh checkout that `npm pack` is run in. So when the compiler or Node's types
// cannot be found from here, the devDependencies are installed first, at the versions of
// package-lock.json, with `npm ci`.

import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const NEEDED = ['typescript/package.json', '@types/node/package.json'];

function missing() {
  const require = createRequire(join(root, 'package.json'));
  return NEEDED.filter((name) => {
    try {
      require.resolve(name);
      return false;
    } catch {
      return true;
    }
  });
}

function fail(message) {
  console.error(`fencegate build: ${message}`);
  process.exit(1);
}

let absent = missing();
if (absent.length > 0) {
  console.error(`fencegate build: ${absent.map((name) => dirname(name)).join(' and ')} not installed; running npm ci in ${root}`);
  const npm = process.env['npm_execpath'];
  // The flags override what an outer `npm install` passes down in npm_config_* (a global
  // install, --omit=dev, NODE_ENV=production): these are the build's own tools.
  const flags = ['ci', '--include=dev', '--global=false', '--ignore-scripts', '--no-audit', '--no-fund', '--loglevel=error'];
  // Its output goes to stderr: `npm pack` prints the tarball's name on stdout.
  const stdio = ['ignore', 2, 2];
  const done = npm?.endsWith('.js')
    ? spawnSync(process.execPath, [npm, ...flags], { cwd: root, stdio })
    : spawnSync('npm', flags, { cwd: root, stdio, shell: process.platform === 'win32' });
  if (done.status !== 0) {
    fail(`npm ci failed; install the build tools by hand with \`npm ci\` in ${root}, then build again`);
  }
  absent = missing();
  if (absent.length > 0) fail(`still missing after npm ci: ${absent.join(', ')}`);
}

const tsc = createRequire(join(root, 'package.json')).resolve('typescript/bin/tsc');
const built = spawnSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.json')], { cwd: root, stdio: ['ignore', 2, 2] });
if (built.status !== 0) fail('tsc failed (see above)');
