"""Conformance tier: the frameworks' own checkpoint tests, run with the vanilla class and with ours.

    python tests/conformance/run.py [hf] [lightning] [--vendor DIR] [--json OUT] [--vanilla | --record]

For each suite, the unmodified upstream files in ``../shared/vendor`` (or ``--vendor`` /
``FLASHCKPT_VENDOR``) are copied to a temporary directory and run with ``flashckpt_conformance`` loaded
(``FlashCkptTrainer`` for every ``transformers.Trainer``, ``FlashCheckpointIO()`` added to every Lightning
``Trainer`` without a CheckpointIO of its own), and compared with the vanilla outcomes. Those come from
``vanilla_baseline.json`` (recorded by ``--record`` for the versions of torch, transformers and Lightning it
names) when it holds the suite for the versions installed and the ours run lost no test against it; else,
and always with ``--vanilla``, the vanilla suite runs too (at the same time as ours, or after it when the
baseline showed a loss, so that a regression is only ever called against a real vanilla run). Every
test that passes vanilla must pass with ours, except the tests listed under "Excused" in
``docs/conformance.md`` (each with its reason), and each listed test must fail with ours and pass
vanilla: the list is expected exactly. Exit status 0 when both hold for every suite, 1 otherwise, 2 when
the vendored tests are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DOC = os.path.join(ROOT, "docs", "conformance.md")
BASELINE = os.path.join(HERE, "vanilla_baseline.json")


@dataclass(frozen=True)
class Suite:
    vendor: str  # folder under the vendor dir
    cwd: str  # where pytest runs, relative to that folder (its rootdir)
    files: tuple[str, ...] | None  # test files relative to cwd; None: read from file_list
    file_list: str | None = None  # a file in the vendor folder listing test files (relative to it)


SUITES = {
    "hf": Suite("transformers-trainer-tests", ".", ("tests/trainer/test_trainer_checkpointing.py",)),
    "lightning": Suite("lightning-2.6.5-tests", "tests", None, "CHECKPOINT_TEST_FILES.txt"),
}


def vendor_dir(given: str | None) -> str:
    return os.path.abspath(given or os.environ.get("FLASHCKPT_VENDOR") or os.path.join(ROOT, "..", "shared", "vendor"))


def excused(suite: str) -> dict[str, str]:
    """The tests ``docs/conformance.md`` excuses for ``suite``: test id -> reason."""
    out: dict[str, str] = {}
    with open(DOC, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^- `(\w+)::([^`]+)`\s*[:\u2014-]*\s*(.*)$", line.strip())
            if m and m.group(1) == suite:
                out[m.group(2)] = m.group(3)
    return out


def outcomes(junit: str) -> dict[str, str]:
    """test id (``module.Class::name``) -> passed / failed / skipped, from a junit XML report."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        out[tid] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return out


def start(suite: Suite, copy: str, mode: str, work: str) -> tuple[subprocess.Popen[bytes], str, str, str]:
    files = list(suite.files or ())
    if suite.file_list:
        with open(os.path.join(copy, suite.file_list)) as f:
            prefix = suite.cwd.rstrip("/") + "/"
            files = [ln.strip().removeprefix(prefix) for ln in f if ln.strip()]
    junit = os.path.join(work, f"{mode}.xml")
    stats = os.path.join(work, f"{mode}.stats.json")
    log = os.path.join(work, f"{mode}.log")
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([HERE, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               FLASHCKPT_CONFORMANCE_STATS=stats,
               # savers that keep snapshots for a restart (after a test's exception) go soon after the test
               FLASHCKPT_SAVER_GRACE_S="5")
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}", "--timeout=900"]
    if mode == "ours":
        cmd += ["-p", "flashckpt_conformance"]
        env["FLASHCKPT_CONFORMANCE_SUITE"] = suite_name(suite)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=os.path.join(copy, suite.cwd), env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, junit, stats, log


def suite_name(suite: Suite) -> str:
    return next(k for k, v in SUITES.items() if v == suite)


def versions() -> dict[str, str]:
    """The versions the vanilla outcomes depend on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers", "lightning"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = ""
    return out


def baseline(name: str) -> dict[str, str] | None:
    """The recorded vanilla outcomes of suite ``name`` for the versions installed, else None."""
    try:
        with open(BASELINE) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if rec.get("versions") != versions() or name not in rec.get("suites", {}):
        return None
    return {str(k): str(v) for k, v in rec["suites"][name].items()}


def record(reports: list[dict]) -> None:
    """Writes the vanilla outcomes of ``reports`` (full runs) into ``vanilla_baseline.json``."""
    try:
        with open(BASELINE) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        rec = {}
    if rec.get("versions") != versions():
        rec = {"versions": versions(), "suites": {}}
    for r in reports:
        rec["suites"][r["suite"]] = r["vanilla_outcomes"]
    with open(BASELINE, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
        f.write("\n")


def _run(suite: Suite, src: str, work: str, modes: tuple[str, ...]) -> tuple[dict[str, dict[str, str]], dict, dict]:
    """Runs ``modes`` of ``suite`` at the same time: (mode -> outcomes, the ours run's swap stats, mode -> log)."""
    procs = {}
    for mode in modes:
        copy = os.path.join(work, mode, suite.vendor)
        shutil.copytree(src, copy)
        procs[mode] = start(suite, copy, mode, work)
    results: dict[str, dict[str, str]] = {}
    for mode, (proc, junit, _stats, log) in procs.items():
        proc.wait()
        if not os.path.exists(junit):
            with open(log, errors="replace") as f:
                tail = f.read()[-4000:]
            raise SystemExit(f"conformance {suite_name(suite)}/{mode}: pytest wrote no report (exit {proc.returncode}):\n{tail}")
        results[mode] = outcomes(junit)
    stats: dict = {}
    if "ours" in procs:
        with open(procs["ours"][2]) as f:
            stats = json.load(f)
    return results, stats, {mode: p[3] for mode, p in procs.items()}


def run_suite(name: str, vendor: str, keep: str | None, *, vanilla: bool = False) -> dict:
    suite = SUITES[name]
    src = os.path.join(vendor, suite.vendor)
    work = tempfile.mkdtemp(prefix=f"flashckpt-conformance-{name}-")
    t0 = time.monotonic()
    want = excused(name)
    try:
        base = None if vanilla else baseline(name)
        results, stats, logs = _run(suite, src, work, ("ours",) if base is not None else ("vanilla", "ours"))
        source = "a vanilla run"
        if base is not None:
            passed_b = {t for t, o in base.items() if o == "passed"}
            passed_o = {t for t, o in results["ours"].items() if o == "passed"}
            if (passed_b - passed_o) - set(want) or set(base) ^ set(results["ours"]):
                # A loss against the record: only a real vanilla run may call it a regression.
                more, _s, more_logs = _run(suite, src, work, ("vanilla",))
                results.update(more)
                logs.update(more_logs)
            else:
                results["vanilla"] = base
                source = "vanilla_baseline.json"
        vanilla_res, ours = results["vanilla"], results["ours"]
        passed_v = {t for t, o in vanilla_res.items() if o == "passed"}
        passed_o = {t for t, o in ours.items() if o == "passed"}
        lost = passed_v - passed_o
        report = {
            "suite": name,
            "seconds": round(time.monotonic() - t0, 1),
            "vanilla_from": source,
            "vanilla": _counts(vanilla_res),
            "ours": _counts(ours),
            "swap": stats,
            "regressions": sorted(lost - set(want)),  # pass vanilla, fail ours, not excused
            "excused_failing": sorted(lost & set(want)),
            "excused_but_passing": sorted(set(want) - lost),  # the list is stale: ours passes, or vanilla fails
            "gained": sorted(passed_o - passed_v),
            "missing": sorted(set(vanilla_res) ^ set(ours)),  # collected in one run only
            "vanilla_outcomes": vanilla_res,
        }
        report["ok"] = not (report["regressions"] or report["excused_but_passing"] or report["missing"]) and \
            stats["ours"] > 0 and stats["not_ours"] == 0
        if not report["ok"] or keep:
            for mode, log in logs.items():
                dest = os.path.join(keep or tempfile.gettempdir(), f"conformance-{name}-{mode}.log")
                shutil.copy(log, dest)
                report[f"{mode}_log"] = dest
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _counts(res: dict[str, str]) -> dict[str, int]:
    return {k: sum(1 for o in res.values() if o == k) for k in ("passed", "failed", "skipped")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", default=[])
    ap.add_argument("--vendor", help="the vendored upstream tests (default: ../shared/vendor)")
    ap.add_argument("--json", help="write the reports here")
    ap.add_argument("--keep-logs", help="copy both runs' pytest output into this directory")
    ap.add_argument("--vanilla", action="store_true", help="run the vanilla suite too, whatever the baseline holds")
    ap.add_argument("--record", action="store_true",
                    help="run the vanilla suite too and record its outcomes in vanilla_baseline.json")
    args = ap.parse_args(argv)
    vendor = vendor_dir(args.vendor)
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
    names = args.suites or list(SUITES)
    missing = [n for n in names if not os.path.isdir(os.path.join(vendor, SUITES[n].vendor))]
    if missing:
        print(f"conformance: the vendored tests of {missing} are not in {vendor} (set FLASHCKPT_VENDOR)")
        return 2
    reports = [run_suite(n, vendor, args.keep_logs, vanilla=args.vanilla or args.record) for n in names]
    if args.record:
        record(reports)
    for r in reports:
        v, o = r["vanilla"], r["ours"]
        print(f"{r['suite']:10s} vanilla: {v['passed']} passed, {v['failed']} failed, {v['skipped']} skipped | "
              f"ours: {o['passed']} passed, {o['failed']} failed, {o['skipped']} skipped | "
              f"excused {len(r['excused_failing'])} | {r['seconds']} s | {'OK' if r['ok'] else 'FAIL'} "
              f"(vanilla from {r['vanilla_from']})")
        print(f"{'':10s} swap: {r['swap']}")
        for key in ("regressions", "excused_but_passing", "missing", "gained"):
            for t in r[key]:
                print(f"{'':10s} {key}: {t}")
        for key in ("vanilla_log", "ours_log"):
            if key in r:
                print(f"{'':10s} {key}: {r[key]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "vanilla_outcomes"} for r in reports], f, indent=1)
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
