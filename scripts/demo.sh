#!/usr/bin/env bash
# The main demo, on CPU: 2-rank DDP training, a rank killed mid-run, a restart that resumes from
# the in-memory snapshot. Creates ./.venv and installs what it needs on first use.
source "$(dirname "$0")/_venv.sh" ""
exec python examples/demo.py "$@"
