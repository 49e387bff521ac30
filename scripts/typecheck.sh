#!/usr/bin/env bash
# mypy sees the code as installed (kvgate.engine, kvgate.operator, ...): the repo-root folder
# names alone would make `operator/` collide with the stdlib module of that name.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVGATE_VENV:-.venv}
tree=.typecheck/kvgate
rm -rf .typecheck && mkdir -p "$tree"
for f in kvgate/*; do ln -s "$PWD/$f" "$tree/"; done
ln -s "$PWD/api" "$tree/api"
for c in engine epp gateway operator; do ln -s "$PWD/$c" "$tree/$c"; done
cd .typecheck && exec "../$VENV/bin/mypy" --config-file ../pyproject.toml kvgate "$@"
