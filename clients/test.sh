#!/usr/bin/env bash
# Builds, checks and tests the Python and TypeScript clients, from a fresh machine:
#
#   clients/test.sh
#
# 1. Installs what is missing: Debian packages (only if a tool is absent), the Python
#    tools into clients/python/.venv, the Node packages with `npm ci`.
# 2. Needs Postgres at 127.0.0.1:5432 (user postgres, trust) and stops at once if it is
#    not there: these tests never skip. Builds target/debug/fencegate if it is missing.
# 3. Python: ruff, mypy --strict, `python -m build` (wheel and sdist), the wheel
#    installed into a fresh venv, pytest against it.
# 4. Node: tsc --strict (the package and its example), `npm pack`, the tarball installed
#    into the test project clients/node/test, node --test against it.
# 5. Installs as a user runs them: a copy of clients/node without node_modules and dist
#    installed as a directory, from a git URL, and packed with `npm pack`; then
#    clients/release.sh, and each artefact it writes installed into a clean environment
#    (a fresh venv for the wheel and for the sdist, a fresh npm project for the tarball)
#    and imported.
#
# Every test starts its own gateways on free ports, each with its own database or data
# directory. Exits non-zero on the first failure.
#
# Env: FENCEGATE_BIN (the gateway binary; default target/debug/fencegate),
# FENCEGATE_TEST_PYTHON (the interpreter the Python tests run on; default the oldest
# supported one found, Python 3.9 or later).
set -euo pipefail

clients=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$clients/.." && pwd)
started=$SECONDS
export FENCEGATE_BIN=${FENCEGATE_BIN:-$root/target/debug/fencegate}

step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)); }
fail() { printf '\nclients/test.sh: FAIL: %s\n' "$*" >&2; exit 1; }

apt_updated=
apt_install() { # apt_install PACKAGE
  if [[ -z $apt_updated ]]; then apt-get update -qq; apt_updated=1; fi
  step "installing $1"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}
need_debian() { # need_debian COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 && return
  apt_install "$2"
  command -v "$1" >/dev/null 2>&1 || fail "$1 is still missing after installing $2"
}

step "tools"
need_debian pg_isready postgresql-client
need_debian psql postgresql-client
need_debian openssl openssl
need_debian node nodejs
need_debian npm npm
need_debian python3 python3
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  apt_install python3-venv
  python3 -c 'import ensurepip, venv' || fail "python3 cannot make virtual environments"
fi
node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' \
  || fail "Node.js 20 or later is needed, this is $(node --version)"

step "postgres"
pg_isready -h 127.0.0.1 -p 5432 -q \
  || fail "Postgres at 127.0.0.1:5432 is not reachable; the client tests need it (user postgres, trust auth)"
psql -X -q -h 127.0.0.1 -p 5432 -U postgres -d postgres -c 'SELECT 1' >/dev/null \
  || fail "Postgres at 127.0.0.1:5432 does not let user postgres in without a password"

step "gateway binary"
if [[ ! -x $FENCEGATE_BIN ]]; then
  (cd "$root" && cargo build -p fencegate-gateway --bin fencegate)
fi
"$FENCEGATE_BIN" --version

# ---------------------------------------------------------------- Python

py=$clients/python
step "python: tools"
[[ -x $py/.venv/bin/python ]] || python3 -m venv "$py/.venv"
"$py/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$py/requirements-dev.txt"

step "python: ruff, mypy --strict"
(
  cd "$py"
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/mypy --strict
)

step "python: build (wheel and sdist)"
rm -rf "$py/dist"
(cd "$py" && .venv/bin/python -m build --no-isolation --outdir dist . >/dev/null)
wheel=$(ls "$py"/dist/fencegate-*-py3-none-any.whl)
sdist=$(ls "$py"/dist/fencegate-*.tar.gz)
# (Listings are read whole first: grep -q would cut the pipe short under pipefail.)
listing=$(python3 -m zipfile -l "$wheel")
grep -q 'fencegate/py.typed' <<<"$listing" || fail "the wheel has no py.typed"
listing=$(tar tzf "$sdist")
grep -q 'src/fencegate/py.typed' <<<"$listing" || fail "the sdist has no py.typed"
echo "built $(basename "$wheel") and $(basename "$sdist")"

step "python: the wheel in a fresh venv"
test_python=${FENCEGATE_TEST_PYTHON:-}
if [[ -z $test_python ]]; then
  # The oldest supported interpreter on the machine, so that 3.9 is what is tested where
  # it exists; else python3.
  for candidate in "$HOME"/.pyenv/versions/3.9.*/bin/python3 "$HOME"/.pyenv/versions/3.10.*/bin/python3 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then test_python=$candidate; break; fi
  done
fi
rm -rf "$py/.venv-test"
"$test_python" -m venv "$py/.venv-test"
"$py/.venv-test/bin/python" -m pip install --quiet --disable-pip-version-check \
  "${wheel}[psycopg,asyncpg]" -r "$py/requirements-test.txt"
echo "tests run on $("$py/.venv-test/bin/python" --version)"

step "python: pytest"
(cd "$py" && .venv-test/bin/python -m pytest -n 4 -q tests)

# ---------------------------------------------------------------- Node

node_dir=$clients/node
step "node: npm ci, tsc --strict, npm pack"
(
  cd "$node_dir"
  npm ci --no-audit --no-fund --loglevel=error
  npx tsc -p tsconfig.json
  npx tsc -p tsconfig.examples.json
  rm -f fencegate-*.tgz
  npm pack --ignore-scripts --silent >/dev/null
)
tarball=$(ls "$node_dir"/fencegate-*.tgz)
listing=$(tar tzf "$tarball")
grep -q 'package/dist/index.d.ts' <<<"$listing" || fail "the tarball has no type declarations"
grep -q 'package/examples/sweeper/sweeper.mjs' <<<"$listing" || fail "the tarball has no example"
echo "packed $(basename "$tarball")"

step "node: the tarball in the test project"
(
  cd "$node_dir/test"
  npm ci --no-audit --no-fund --loglevel=error
  npm install --no-save --no-audit --no-fund --loglevel=error "$tarball"
  rm -rf build
  npx tsc -p tsconfig.json
)

step "node: node --test"
(cd "$node_dir/test" && node --test --test-concurrency=4 build/)

# ---------------------------------------------------------------- installs

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
quiet_npm=(--no-audit --no-fund --loglevel=error)

fresh_node_copy() { # fresh_node_copy DIR: clients/node as a fresh checkout has it
  mkdir -p "$1"
  tar -C "$node_dir" --exclude=./node_modules --exclude=./dist --exclude='./*.tgz' \
    --exclude=./test/node_modules --exclude=./test/build -cf - . | tar -C "$1" -xf -
}
new_npm_project() { # new_npm_project DIR
  mkdir -p "$1"
  (cd "$1" && npm init -y >/dev/null)
}
# Imports the installed package in the project of the current directory and uses it.
node_uses_fencegate='
  const { checkToken, Gateway, VERSION } = await import("fencegate");
  if (checkToken(7) !== 7n) throw new Error("checkToken(7) is not 7n");
  if (new Gateway("http://127.0.0.1:7070").url !== "http://127.0.0.1:7070") throw new Error("Gateway.url");
  console.log(`fencegate ${VERSION} imported`);'

step "node: npm install of a checkout directory (prepare builds dist)"
fresh_node_copy "$scratch/checkout/node"
new_npm_project "$scratch/from-directory"
(
  cd "$scratch/from-directory"
  npm install "${quiet_npm[@]}" "$scratch/checkout/node"
  [[ -f node_modules/fencegate/dist/index.js ]] || fail "npm install of the directory built no dist/"
  node --input-type=module -e "$node_uses_fencegate"
)

step "node: npm install from a git URL (prepare builds dist)"
# npm installs a git URL's package from the repository's root: a repository that holds
# clients/node at its root stands in for one.
fresh_node_copy "$scratch/repo"
git -C "$scratch/repo" init -q
git -C "$scratch/repo" add -A
git -C "$scratch/repo" -c user.name=test -c user.email=test@localhost commit -q -m "clients/node"
new_npm_project "$scratch/from-git"
(
  cd "$scratch/from-git"
  npm install "${quiet_npm[@]}" "git+file://$scratch/repo"
  node --input-type=module -e "$node_uses_fencegate"
)

step "node: npm pack in a fresh checkout"
fresh_node_copy "$scratch/pack"
(
  cd "$scratch/pack"
  packed=$(npm pack --silent)
  [[ $packed == fencegate-*.tgz && -f $packed ]] || fail "npm pack in a fresh checkout printed '$packed'"
  listing=$(tar tzf "$packed")
  grep -q 'package/dist/index.js' <<<"$listing" || fail "npm pack in a fresh checkout packed no dist/"
)

step "release: clients/release.sh, each artefact installed into a clean environment"
"$clients/release.sh" --help >/dev/null
"$clients/release.sh" --out "$scratch/release" >/dev/null
(cd "$scratch/release" && sha256sum --check --quiet SHA256SUMS) || fail "SHA256SUMS does not match the artefacts"
version=$(cd "$py" && .venv/bin/python -c 'import runpy; print(runpy.run_path("src/fencegate/_version.py")["__version__"])')
for artefact in "$scratch/release"/fencegate-"$version"-py3-none-any.whl "$scratch/release"/fencegate-"$version".tar.gz; do
  [[ -f $artefact ]] || fail "release.sh wrote no $(basename "$artefact")"
  venv="$scratch/venv-$(basename "$artefact")"
  "$test_python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$artefact"
  imported=$(cd "$scratch" && "$venv/bin/python" -c 'import fencegate; print(fencegate.__version__)')
  [[ $imported == "$version" ]] || fail "$(basename "$artefact") imports as version '$imported'"
  echo "$(basename "$artefact"): fencegate $imported imported"
done
new_npm_project "$scratch/from-tarball"
(
  cd "$scratch/from-tarball"
  npm install "${quiet_npm[@]}" "$scratch/release/fencegate-$version.tgz"
  node --input-type=module -e "$node_uses_fencegate"
)

step "all passed"
