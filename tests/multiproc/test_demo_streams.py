"""The demo (``examples/demo.py``) shows its training job's output as the job writes it, not at its end
(#34): its runner hands each line on while the child still runs. The child here prints, then waits for a
sign that only the runner's reader can give after seeing that line."""

from __future__ import annotations

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)

import demo  # noqa: E402

CHILD = """
import os, sys, time
print("[rank 0] first", flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("[rank 0] saw the reader's sign" if os.path.exists(sys.argv[1]) else "[rank 0] no sign: not streamed")
"""


def test_the_demo_runner_hands_on_each_line_while_the_job_runs(tmp_path) -> None:
    sign = str(tmp_path / "seen")
    shown: list[str] = []

    def show(line: str) -> None:
        shown.append(line)
        if line == "[rank 0] first":
            open(sign, "w").close()  # only a reader that got the line before the child's end gives the sign

    rc, lines = demo.stream([sys.executable, "-c", CHILD, sign], dict(os.environ), show)
    assert rc == 0 and shown == lines == ["[rank 0] first", "[rank 0] saw the reader's sign"], lines
