"""The conformance tier: the frameworks' own checkpoint tests pass with flashckpt's adapters swapped in.

Each test runs one vendored upstream suite twice (vanilla and with ours) through
``tests/conformance/run.py`` and fails on any test that passes vanilla and fails with ours, unless
``docs/conformance.md`` excuses it (and then it must still fail with ours: the list is exact), or when the
swap did not take. Needs the vendored tests (``../shared/vendor`` or ``FLASHCKPT_VENDOR``): skipped
without them, except under CI (``CI`` set), where their absence fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as conformance  # noqa: E402

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(1500)]


@pytest.mark.parametrize("suite", ["hf", "lightning"])
def test_upstream_checkpoint_tests_pass_with_flashckpt(suite, tmp_path):
    vendor = conformance.vendor_dir(None)
    if not os.path.isdir(os.path.join(vendor, conformance.SUITES[suite].vendor)):
        if os.environ.get("CI"):
            pytest.fail(f"the vendored {suite} tests are missing from {vendor}: the conformance tier cannot run")
        pytest.skip(f"the vendored {suite} tests are not in {vendor} (set FLASHCKPT_VENDOR)")
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), suite, "--json", str(out),
                           "--keep-logs", str(tmp_path)], capture_output=True, text=True)
    print(proc.stdout[-20000:], proc.stderr[-5000:])
    assert out.exists(), f"the conformance runner failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    [report] = json.loads(out.read_text())
    assert report["swap"]["ours"] > 0 and report["swap"]["not_ours"] == 0, report["swap"]
    assert not report["regressions"], f"pass vanilla, fail with flashckpt: {report['regressions']}\n{proc.stdout}"
    assert not report["excused_but_passing"], ("docs/conformance.md excuses tests that pass with flashckpt (or "
                                               f"fail vanilla): {report['excused_but_passing']}")
    assert not report["missing"], f"collected in one run only: {report['missing']}"
    assert proc.returncode == 0, proc.stdout
