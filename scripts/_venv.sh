# Sourced by demo.sh and test.sh: creates ./.venv once and installs the project with the given extras.
# Every install goes through constraints.txt, which pins torch==2.13.0 (the CPU wheel).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLASHCKPT_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.flashckpt-installed-$(echo "$EXTRAS" | tr ',' '-')-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # DS_BUILD_OPS=0: DeepSpeed builds its ops on first use instead of at install time.
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu
cd "$ROOT"
