#!/usr/bin/env bash
# The test suite, on CPU. Creates ./.venv and installs the project with its test extras and every
# framework it integrates with on first use.
source "$(dirname "$0")/_venv.sh" "dev,all"
set +e
python -m pytest "$@"
rc=$?
# pytest's 5 means no test was collected: that is a failure of the suite, not a pass.
exit $rc
