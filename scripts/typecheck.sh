#!/usr/bin/env bash
# ruff and mypy over the library, the examples and the benchmarks (CI runs this before the tests).
# mypy does not run import hooks, so it cannot see the editable install's mapping of the source folders
# (flashckpt_core/ -> flashckpt, integrations/ -> flashckpt.integrations, patches/ -> flashckpt.patches):
# the package is laid out as installed, in build/typecheck/flashckpt, with links to the sources.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ruff check flashckpt_core integrations patches tests benchmarks examples
TREE="$ROOT/build/typecheck"
rm -rf "$TREE" && mkdir -p "$TREE/flashckpt"
for f in flashckpt_core/*; do ln -s "$ROOT/$f" "$TREE/flashckpt/$(basename "$f")"; done
ln -s "$ROOT/integrations" "$TREE/flashckpt/integrations"
ln -s "$ROOT/patches" "$TREE/flashckpt/patches"
MYPYPATH="$TREE" mypy -p flashckpt
MYPYPATH="$TREE" mypy --explicit-package-bases examples benchmarks
