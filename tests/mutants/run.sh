#!/usr/bin/env bash
# Plants each one-line mutant of tests/mutants/*.patch, alone, in a scratch copy of the
# committed tree, and requires the tests it names to fail: a guarantee whose break no
# test notices is a hole in the suite.
#
#   tests/mutants/run.sh                      # every mutant
#   tests/mutants/run.sh tests/mutants/enforce-without-for-share.patch
#
# Each patch starts with a line saying what the mutant breaks and a line
# `# test: <command>` naming the tests that must catch it (run from the scratch copy).
# The scratch copy is a detached git worktree of HEAD in $MUTANTS_DIR (default
# /tmp/fencegate-mutants), reset before each mutant; its builds share one target
# directory there, so after the first build each mutant costs an incremental build.
# Needs what the named tests need (see the README); prints KILLED or SURVIVED per
# mutant and exits non-zero if any survived.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
scratch=${MUTANTS_DIR:-/tmp/fencegate-mutants}
tree=$scratch/tree
export CARGO_TARGET_DIR=$scratch/target

head=$(git -C "$root" rev-parse HEAD)
if [[ ! -d $tree ]]; then
  mkdir -p "$scratch"
  git -C "$root" worktree add --quiet --detach "$tree" "$head"
fi

if [[ $# -gt 0 ]]; then
  patches=("$@")
else
  patches=("$root"/tests/mutants/*.patch)
fi

survived=()
for patch in "${patches[@]}"; do
  patch=$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")
  name=$(basename "$patch" .patch)
  command=$(sed -n 's/^# test: //p' "$patch" | head -1)
  if [[ -z $command ]]; then
    echo "$name: no '# test:' line" >&2
    exit 2
  fi
  git -C "$tree" checkout --quiet --detach --force "$head"
  git -C "$tree" clean --quiet -fd
  git -C "$tree" apply "$patch"
  printf '%-32s ' "$name"
  log=$scratch/$name.log
  if ! (cd "$tree" && cargo build --quiet --workspace --bins --examples) >"$log" 2>&1; then
    echo "KILLED (does not build; see $log)"
    continue
  fi
  if (cd "$tree" && $command) >>"$log" 2>&1; then
    echo "SURVIVED: $command passes (see $log)"
    survived+=("$name")
  else
    echo "KILLED by $command"
  fi
done
git -C "$tree" checkout --quiet --detach --force "$head"

if [[ ${#survived[@]} -gt 0 ]]; then
  echo "survivors: ${survived[*]}" >&2
  exit 1
fi
