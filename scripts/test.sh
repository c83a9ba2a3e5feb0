#!/usr/bin/env bash
# The test suite, on CPU. Creates ./.venv and installs the project with its test extras and every
# framework it integrates with on first use; then ruff and mypy (scripts/typecheck.sh), then pytest.
# Arguments go to pytest (tiers: -m unit | multiproc | framework | conformance | gpu).
source "$(dirname "$0")/_venv.sh" "dev,all"
set +e
# The C++ fast path compiles (about a minute, once per torch version: cached) while ruff and mypy run: the
# test session then finds it built (tests/conftest.py builds it before any test otherwise).
native_build=""
case "${FLASHCKPT_NATIVE:-auto}" in
  0|off|false|no) ;;
  *) flashckpt native --build >/dev/null 2>&1 & native_build=$! ;;
esac
bash scripts/typecheck.sh
checks=$?
[ -n "$native_build" ] && wait "$native_build"
# The test files run on two worker processes (pytest-xdist; each file's tests on one worker, in order):
# about twice as fast on two cores. They are handed out in collection order, which tests/conftest.py makes
# heaviest first (--no-loadscope-reorder: xdist would order them by number of tests, and the longest files,
# of few tests, would start last and run alone). FLASHCKPT_TEST_WORKERS=0 (or -n 0) runs them in this process.
python -m pytest -n "${FLASHCKPT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
# pytest's 5 means no test was collected: that is a failure of the suite, not a pass.
if [ $rc -eq 0 ] && [ $checks -ne 0 ]; then
  echo "ruff/mypy failed (scripts/typecheck.sh): see above" >&2
  rc=$checks
fi
exit $rc
