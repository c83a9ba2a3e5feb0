#!/usr/bin/env bash
# (Re)makes .whl from scratch: the wheels scripts/gpu.sh installs on a lent GPU machine, which has Python 3.12,
# a CUDA torch, Lightning, transformers and their dependencies, but neither DeepSpeed nor megatron-core nor what
# they need beyond that (DeepSpeed: hjson, pydantic and its dependencies), and no package registry. One version
# of each package; cp312 manylinux x86_64 wheels where a wheel is platform-specific; never torch.
#
# - megatron-core 0.16.1: a cp312 platform wheel (its compiled dataset helpers); needs torch, numpy, packaging.
# - deepspeed 0.19.8: published as an sdist only; built here into a pure wheel (py3-none-any) with none of its
#   ops (DS_BUILD_OPS=0), with the project's venv (DeepSpeed's setup.py imports torch): run this inside it.
# - typing-extensions: pydantic 2.14 needs >= 4.16, newer than a GPU machine's torch may bring; the wheel
#   shadows the machine's copy (/tmp/site comes before its site-packages), which is backward compatible.
#
# .whl is not tracked (it is in .git/info/exclude) but travels with the working tree to the device machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl
mkdir .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  megatron-core==0.16.1 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w .whl deepspeed==0.19.8
# checks: DeepSpeed's wheel is pure, no package twice, and well under what a tree that travels may hold
ls .whl/deepspeed-0.19.8-py3-none-any.whl > /dev/null
dupes=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]'; done | sort | uniq -d)
[ -z "$dupes" ] || { echo "gpu_wheels.sh: more than one wheel of: $dupes" >&2; exit 1; }
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
[ "$total" -lt $((40 << 20)) ] || { echo "gpu_wheels.sh: .whl holds $total bytes (limit 40 MiB)" >&2; exit 1; }
ls -l .whl
echo "gpu_wheels.sh: $(ls .whl | wc -l) wheels, $total bytes"
