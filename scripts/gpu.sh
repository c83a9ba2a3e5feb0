#!/usr/bin/env bash
# The checks for a lent GPU machine in one command: the `gpu` test tier (tests/gpu/test_gpu.py and
# tests/gpu/test_gpu_frameworks.py), the CUDA benchmark (benchmarks/bench_gpu.py) and, on request, the
# replica's step-time runs of
# benchmarks/bench_nodes.py (simulated nodes: root and unshare; a host with spare cores, which this VM is
# not). Logs and reports go into $OUT (default bench_out/gpu).
#
# It runs under the machine's own Python and torch (a CUDA build: the project's .venv holds the CPU wheel),
# with flashckpt laid out from the source folders on PYTHONPATH, as installed, so that it needs no package
# registry. What it needs besides torch: xxhash, numpy, pytest, pytest-timeout; transformers for the
# Trainer test (skipped without it), lightning for the Lightning test. DeepSpeed and megatron-core, and
# what they need that such a machine lacks, travel as wheels in .whl (made by scripts/gpu_wheels.sh, not
# tracked): where .whl is present they are installed into /tmp/site, which goes on PYTHONPATH after the
# flashckpt site dir (the machine's own torch and Lightning stay in use; no wheel there is torch), and the
# framework tests then fail rather than skip when one is missing. Knobs: PYTHON (default python3),
# GPU_PARTS (which parts, in this order: default "tests,bench"; add "nodes" for the step-time runs),
# GPU_BENCH_SIZES (default 1,4), GPU_BENCH_ROUNDS (3), GPU_TEST_FILES (both test files), GPU_TEST_TIMEOUT_S (300, both test files), GPU_BENCH_TIMEOUT_S (300),
# NODES_ARGS (bench_nodes flags, default "--only steady,loopback --steady-steps 16"), NODES_ROUNDS (2:
# bench_nodes --rounds), NODES_TIMEOUT_S (420).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/bench_out/gpu}"
PARTS=",${GPU_PARTS:-tests,bench},"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
mkdir -p "$SITE/flashckpt"
cp -r flashckpt_core/. "$SITE/flashckpt/"
cp -r integrations "$SITE/flashckpt/integrations"
cp -r patches "$SITE/flashckpt/patches"
wheels=""  # "": no .whl here; else the exit status of their install
WHEEL_SITE=""
if compgen -G ".whl/*.whl" > /dev/null; then
  # --no-deps: the set in .whl is complete for this machine (scripts/gpu_wheels.sh); torch is never in it
  WHEEL_SITE=/tmp/site
  rm -rf "$WHEEL_SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WHEEL_SITE" \
    .whl/*.whl 2>&1 | tee "$OUT/wheels.log"
  wheels=${PIPESTATUS[0]}
fi
export PYTHONPATH="$SITE${WHEEL_SITE:+:$WHEEL_SITE}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{
  date -Is
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
  nproc; free -g | head -2; df -h /dev/shm /tmp | cat; uptime
} 2>&1 | tee "$OUT/machine.txt"
# The benchmark keeps up to ~5x the largest state in /dev/shm and pinned memory: a small /dev/shm (containers
# often give 64 MB) is enlarged where we may (root), else FLASHCKPT_RUNTIME_DIR goes to a tmpfs of our own.
need_gb=$(( $(echo "${GPU_BENCH_SIZES:-1,4}" | tr ',' '\n' | sort -g | tail -1 | cut -d. -f1) * 4 + 8 ))
have_gb=$(df -BG --output=size /dev/shm | tail -1 | tr -dc '0-9')
if [ "${have_gb:-0}" -lt "$need_gb" ]; then
  mount -o remount,size="${need_gb}G" /dev/shm 2>&1 | tee -a "$OUT/machine.txt" || true
fi
# The C++ fast path, built ahead (a build inside the benchmark would stop its first save for the compile):
# the snapshot's device copies are queued in one call of it.
export FLASHCKPT_EXT_DIR="${FLASHCKPT_EXT_DIR:-/tmp/flashckpt-ext}"
"$PY" -c 'import time; t = time.time(); import flashckpt.util.native as n; n.build(); print(f"native fast path built in {time.time() - t:.0f} s")' \
  2>&1 | tail -3 | tee -a "$OUT/machine.txt"
status=""
worst=0
note() { status="$status $1: exit $2;"; [ "$2" -ne 0 ] && [ "$worst" -eq 0 ] && worst=$2; }
[ -n "$wheels" ] && note "wheels" "$wheels"
if [[ "$PARTS" == *,nodes,* ]]; then
  # The step-time rows (replica capped, uncapped, off) NODES_ROUNDS times, each round in a rotated order; the
  # log has every run's step as it ends, so a timeout keeps the runs done.
  # shellcheck disable=SC2086
  timeout "${NODES_TIMEOUT_S:-420}" "$PY" -m benchmarks.bench_nodes \
    ${NODES_ARGS:---only steady,loopback --steady-steps 16} --rounds "${NODES_ROUNDS:-2}" \
    --out "$OUT/nodes.md" 2>&1 | tee "$OUT/bench_nodes.log"
  note "bench_nodes" "${PIPESTATUS[0]}"
fi
if [[ "$PARTS" == *,tests,* ]]; then
  # DeepSpeed on the CUDA accelerator, building none of its ops (the tests use torch's Adam through it)
  DS_ACCELERATOR=cuda DS_BUILD_OPS=0 FLASHCKPT_GPU_FRAMEWORKS_REQUIRED="${WHEEL_SITE:+1}" \
    timeout "${GPU_TEST_TIMEOUT_S:-300}" "$PY" -m pytest ${GPU_TEST_FILES:-tests/gpu/test_gpu.py tests/gpu/test_gpu_frameworks.py} \
    -m gpu -q -p no:cacheprovider -o addopts="-ra --strict-markers" --durations=0 2>&1 | tee "$OUT/gpu_tests.log"
  note "gpu tests" "${PIPESTATUS[0]}"
fi
if [[ "$PARTS" == *,bench,* ]]; then
  timeout "${GPU_BENCH_TIMEOUT_S:-300}" "$PY" -m benchmarks.bench_gpu --sizes "${GPU_BENCH_SIZES:-1,4}" --rounds "${GPU_BENCH_ROUNDS:-3}" \
    --out "$OUT" --work "${GPU_BENCH_WORK:-/tmp/bench_gpu_work}" 2>&1 | tee "$OUT/bench_gpu.log"
  note "bench_gpu" "${PIPESTATUS[0]}"
fi
rm -rf "$SITE" ${WHEEL_SITE:+"$WHEEL_SITE"} "${GPU_BENCH_WORK:-/tmp/bench_gpu_work}"
echo "gpu.sh:$status"
exit "$worst"
