#!/usr/bin/env bash
# Builds the release artefacts of both clients into one directory, with their checksums.
# Run `clients/release.sh --help` for the usage.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: clients/release.sh [--out DIR]

Builds the release artefacts of the fencegate clients into one directory:

  fencegate-<version>-py3-none-any.whl   the Python wheel      (python -m build)
  fencegate-<version>.tar.gz             the Python sdist      (python -m build)
  fencegate-<version>.tgz                the npm tarball       (npm ci, then npm pack)
  SHA256SUMS                             their SHA-256 sums    (check: sha256sum -c SHA256SUMS)

Options:
  --out DIR   where to write them (default: clients/dist-release). Earlier artefacts
              there (fencegate-* and SHA256SUMS) are replaced; nothing else is touched.
  -h, --help  this text

Needs python3 (with venv) and Node.js 20 or later with npm. The Python build tools are
installed into clients/python/.venv at the versions of requirements-dev.txt, as
clients/test.sh does; the Node build tools into clients/node/node_modules with npm ci.
Fails if the Python and npm packages do not carry the same version.
EOF
}

clients=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=$clients/dist-release
while [[ $# -gt 0 ]]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --out)
      [[ $# -ge 2 ]] || { echo "release.sh: --out needs a directory" >&2; exit 2; }
      out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    *) echo "release.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/fencegate-* "$out/SHA256SUMS"

py=$clients/python
echo "== Python: wheel and sdist"
[[ -x $py/.venv/bin/python ]] || python3 -m venv "$py/.venv"
"$py/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$py/requirements-dev.txt"
(cd "$py" && .venv/bin/python -m build --no-isolation --outdir "$out" . >/dev/null)

echo "== Node: npm tarball"
(
  cd "$clients/node"
  # --ignore-scripts: npm pack runs `prepare`, which builds dist/, once.
  npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
  npm pack --silent --pack-destination "$out" >/dev/null
)

cd "$out"
wheels=(fencegate-*-py3-none-any.whl)
tarballs=(fencegate-*.tgz)
python_version=${wheels[0]#fencegate-}
python_version=${python_version%%-*}
node_version=${tarballs[0]#fencegate-}
node_version=${node_version%.tgz}
if [[ $python_version != "$node_version" ]]; then
  echo "release.sh: the Python package is $python_version, the npm package $node_version: make them equal" >&2
  exit 1
fi
sha256sum fencegate-* >SHA256SUMS
echo "== fencegate $python_version in $out"
cat SHA256SUMS
