"""Per-test isolation and hygiene for the flashckpt test suite.

Every test gets its own FLASHCKPT_RUNTIME_DIR (short, under /dev/shm, so Unix socket paths stay far below
107 characters), a short saver grace period and bounded commit/RPC timeouts. Hygiene fixtures fail a
test that leaks: an engine left open, a saver daemon of its runtime dir still alive after its engines
closed, files left in its runtime dir (segments, sockets, locks), threads, child processes or
environment variables. Savers started by a test run as detached daemons, so they are found by scanning
/proc for the saver daemon (``flashckpt.saver.daemon``) with the test's runtime dir on their command line.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading

import pytest

# The support code (helpers, fixtures, trainer scripts run as subprocesses) is importable from every tier.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from helpers import child_pids, leftovers, saver_pids, wait_for  # noqa: E402

# A saver whose trainers closed with release=False (or crashed) keeps its snapshots this long.
DEFAULT_GRACE_S = 20.0
# How long a test's savers may take to exit after the test closed its engines: they exit at once after
# final goodbyes, after the grace period otherwise.
SAVER_EXIT_TIMEOUT_S = DEFAULT_GRACE_S + 30.0


def _describe_savers(pids: dict[int, list[str]]) -> str:
    lines = []
    for pid, argv in pids.items():
        lines.append(f"pid {pid}: {' '.join(argv)}")
        job = argv[argv.index("--job-dir") + 1] if "--job-dir" in argv else None
        if job:
            try:
                with open(os.path.join(job, "saver.log"), "rb") as f:
                    lines.append(f.read()[-3000:].decode(errors="replace"))
            except OSError:
                pass
    return "\n".join(lines)


def _stop_savers(pids: dict[int, list[str]], runtime_dir: str) -> None:
    """Ends savers this test started and failed to stop: SIGTERM (a clean exit), then SIGKILL."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        wait_for(lambda: not saver_pids(runtime_dir), 30, "the savers to exit after SIGTERM")
    except TimeoutError:
        for pid in saver_pids(runtime_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is a worker of a parallel run (``pytest -n N``: pytest-xdist)."""
    return hasattr(config, "workerinput")


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this process runs no tests itself but hands them to xdist workers."""
    return not _xdist_worker(config) and bool(getattr(config.option, "numprocesses", None))


def pytest_sessionstart(session: pytest.Session) -> None:
    """A parallel run builds what every worker loads (the C++ fast path, DeepSpeed's CPU op) once, here, before
    any worker starts: a worker then finds them built, and no worker takes another's build lock for stale."""
    if not _xdist_controller(session.config):
        return
    if os.environ.get("FLASHCKPT_NATIVE", "auto").strip().lower() not in ("0", "off", "false", "no"):
        try:
            from flashckpt.util import native as _native

            _native.build()
        except Exception:  # each worker's _native_fast_path says why and falls back
            pass
    if importlib.util.find_spec("deepspeed") is not None:
        # In the background: the workers run other files meanwhile, and a test of a DeepSpeed file waits for
        # the build's end (``_deepspeed_op_ready``); the workers inherit the marker's name.
        fd, marker = tempfile.mkstemp(prefix="fct-deepspeed-op-", suffix=".done")
        os.close(fd)
        os.unlink(marker)
        os.environ[_DS_BUILD_MARKER] = marker
        session.config._deepspeed_build = threading.Thread(  # type: ignore[attr-defined]
            target=_build_deepspeed_op_to, args=(marker,), name="deepspeed-op-build", daemon=True)
        session.config._deepspeed_build.start()  # type: ignore[attr-defined]


def _build_deepspeed_op_to(marker: str) -> None:
    """``_build_deepspeed_op``, then its notes into ``marker`` (written whole: a rename)."""
    try:
        notes = _build_deepspeed_op()
    except Exception as e:  # the tests that need it fail on their own terms, with this in the marker
        notes = [f"the build failed: {e!r}"]
    with open(marker + ".tmp", "w") as f:
        f.write("; ".join(notes))
    os.replace(marker + ".tmp", marker)


def _report_deepspeed_build(session: pytest.Session) -> None:
    """Says what the background build of DeepSpeed's CPU op did (a parallel run's controller)."""
    marker = os.environ.get(_DS_BUILD_MARKER)
    if not _xdist_controller(session.config) or not marker:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    try:
        with open(marker) as f:
            notes = f.read()
        os.unlink(marker)
    except OSError:
        notes = "not finished"
    if reporter is not None:
        reporter.write_line(f"DeepSpeed's CPU shm op (built in the background): {notes}")


@pytest.fixture(scope="session", autouse=True)
def _native_fast_path():
    """Builds the C++ fast path once (cached across runs), before any test: engines then use it, as on a
    machine where it was built, and no test starts a background build. FLASHCKPT_NATIVE=0 runs the whole
    suite on the Python fallback instead; tests/multiproc/test_native.py covers both either way."""
    from flashckpt.util import native as _native

    if os.environ.get("FLASHCKPT_NATIVE", "auto").strip().lower() not in _native._OFF:
        try:
            _native.build()
        except Exception as e:  # no compiler here: the suite runs the Python path; test_native says why
            import warnings

            warnings.warn(f"the native fast path did not build ({e}); testing the Python path only", stacklevel=1)
            os.environ["FLASHCKPT_NATIVE"] = "0"
    yield


# Test files whose ranks run DeepSpeed (its CPU shared-memory allreduce op is JIT-built on first use).
_DEEPSPEED_FILES = {"test_deepspeed.py", "test_dlrover_guide.py", "test_hf.py", "test_s3_dist_adapters.py", "test_export.py",
                    "test_conformance.py"}


def _deepspeed_build_lock() -> str:
    """The file lock torch's JIT builder takes around every load of DeepSpeed's CPU shm op (built or not)."""
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.join(_get_build_directory("deepspeed_shm_comm", False), "lock")


def _drop_stale_deepspeed_lock() -> bool:
    try:
        os.unlink(_deepspeed_build_lock())
        return True
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_op_built(request):
    """Builds DeepSpeed's CPU shared-memory op once, before any test starts DeepSpeed ranks (cached across runs).

    DeepSpeed JIT-compiles it in the first ``deepspeed.init_distributed`` of a fresh machine (half a minute or
    more on two cores), and every later load still takes torch's build lock, a plain file: a rank killed while
    holding it (a test's time limit) leaves it behind, and every later DeepSpeed process of the machine waits on
    it forever (CI saw every DeepSpeed test of a run time out so). Before the first test no DeepSpeed process of
    this session runs, so a lock found then is stale and removed; the op is then built in a child of the pytest
    process that no test kills, and the ranks only load it. What happened goes to the terminal. In a parallel
    run (``-n``) the controller does this before any worker starts (``pytest_sessionstart``)."""
    if importlib.util.find_spec("deepspeed") is None or _xdist_worker(request.config) or not any(
            os.path.basename(str(item.path)) in _DEEPSPEED_FILES for item in request.session.items):
        yield  # (an xdist worker: the controller built it before any worker started)
        return
    notes = _build_deepspeed_op()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"DeepSpeed's CPU shm op: {'; '.join(notes)}")
    yield


def _build_deepspeed_op() -> list[str]:
    """Removes a stale build lock and builds DeepSpeed's CPU shm op in a child process (see
    ``_deepspeed_op_built``); returns what happened, for the terminal."""
    import subprocess
    import sys
    import time

    notes = ["removed a stale build lock"] if _drop_stale_deepspeed_lock() else []
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "print('built' if b is not None and b.load() is not None else 'not used on this machine')")
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1200)
        notes += out.stdout.strip().splitlines()[-1:] or [f"exit {out.returncode}: {out.stderr[-2000:]}"]
    except subprocess.TimeoutExpired:
        notes.append("the build timed out after 1200 s")
    notes.append(f"{time.monotonic() - start:.0f} s")
    return notes


_DS_BUILD_MARKER = "_FCT_DEEPSPEED_OP_MARKER"  # set by a parallel run's controller for its workers
_DS_BUILD_WAIT_S = 1500.0


@pytest.fixture(autouse=True)
def _deepspeed_op_ready(request):
    """In a parallel run, a test of a DeepSpeed file waits until the controller's background build of the op
    ended (``pytest_sessionstart``): its ranks then only load it."""
    marker = os.environ.get(_DS_BUILD_MARKER)
    if marker and _xdist_worker(request.config) and os.path.basename(str(request.node.path)) in _DEEPSPEED_FILES:
        import time

        deadline = time.monotonic() + _DS_BUILD_WAIT_S
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                pytest.fail(f"DeepSpeed's CPU shm op was not built within {_DS_BUILD_WAIT_S:.0f} s")
            time.sleep(0.5)
    yield


@pytest.fixture(autouse=True)
def _deepspeed_lock_hygiene(request):
    """After a test that ran DeepSpeed ranks (all ended by then: see _thread_and_child_hygiene), a build lock
    left behind belongs to a rank the test killed mid-load; it is removed so that it cannot stall the next
    tests, with a warning (the test that killed the rank has already failed on its own terms)."""
    yield
    if os.path.basename(str(request.node.path)) in _DEEPSPEED_FILES and importlib.util.find_spec("deepspeed"):
        if _drop_stale_deepspeed_lock():
            import warnings

            warnings.warn("a DeepSpeed rank killed while loading its shm op left torch's build lock: removed",
                          stacklevel=1)


@pytest.fixture(autouse=True)
def _env_hygiene():
    """Fails a test that leaves environment variables changed (set up first, checked last)."""
    # pytest itself updates PYTEST_CURRENT_TEST around every phase; torch's inductor sets its cache dir
    # once, on first use (AdamW's compiled paths import it), in every process; Intel's OpenMP runtime, where
    # a library brings it (seen with transformers on a GPU machine), sets its KMP_ variables at import.
    ignored = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}

    def env():
        return {k: v for k, v in os.environ.items() if k not in ignored}

    before = env()
    yield
    after = env()
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for k in set(after) - set(before):
            del os.environ[k]
        os.environ.update(before)
        pytest.fail(f"the test leaked environment changes: {changed}")


@pytest.fixture(autouse=True)
def _thread_and_child_hygiene():
    """Fails a test that leaves threads or child processes of the pytest process behind."""
    threads_before = set(threading.enumerate())
    children_before = set(child_pids())
    yield

    def extra_threads():
        return [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]

    def extra_children():
        return [p for p in child_pids() if p not in children_before]

    try:
        wait_for(lambda: not extra_threads() and not extra_children(), 10, "threads and children to end")
    except TimeoutError:
        threads, children = extra_threads(), extra_children()
        for pid in children:  # only processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the test leaked threads {[t.name for t in threads]} and/or child processes {children}")


@pytest.fixture(autouse=True)
def runtime_dir(_env_hygiene, _thread_and_child_hygiene, monkeypatch):
    """An isolated FLASHCKPT_RUNTIME_DIR; at teardown its savers must exit and leave nothing behind."""
    path = tempfile.mkdtemp(prefix="fct-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", path)
    monkeypatch.setenv("FLASHCKPT_SAVER_GRACE_S", str(DEFAULT_GRACE_S))
    monkeypatch.setenv("FLASHCKPT_COMMIT_TIMEOUT_S", "60")
    monkeypatch.setenv("FLASHCKPT_RPC_TIMEOUT_S", "60")
    monkeypatch.setenv("FLASHCKPT_SAVER_LOG_LEVEL", "INFO")
    monkeypatch.delenv("FLASHCKPT_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("FLASHCKPT_SHM_LIMIT_BYTES", raising=False)
    monkeypatch.delenv("FLASHCKPT_SLOTS", raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    yield path
    problems = []
    try:
        wait_for(lambda: not saver_pids(path), SAVER_EXIT_TIMEOUT_S, "the test's savers to exit")
    except TimeoutError:
        alive = saver_pids(path)
        problems.append(f"saver daemons still running after the test closed its engines:\n{_describe_savers(alive)}")
        _stop_savers(alive, path)
    left = leftovers(path)
    if left:
        problems.append(f"files left in the runtime dir: {left}")
    shutil.rmtree(path, ignore_errors=True)
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh checkpoint dir for the test."""
    d = tmp_path / "ckpt"
    d.mkdir()
    return str(d)


@pytest.fixture
def make_engine(runtime_dir, ckpt_dir):
    """Builds CheckpointEngines (on ``ckpt_dir`` unless told otherwise) and fails the test if one is left
    open; a leftover is closed with release=True so its saver exits."""
    from flashckpt import CheckpointEngine

    engines = []

    def make(checkpoint_dir: str | None = None, **kw):
        eng = CheckpointEngine(checkpoint_dir or ckpt_dir, **kw)
        engines.append(eng)
        return eng

    yield make
    # `_closed` is the engine's own record of close(); there is no public accessor for it.
    left_open = [e for e in engines if not e._closed]
    for e in left_open:
        e.close(release=True)
    if left_open:
        pytest.fail(f"{len(left_open)} CheckpointEngine(s) left open by the test")


def pytest_sessionfinish(session, exitstatus):
    """Tests that SIGKILL a launcher leave its module-record directory in the temp dir (the next launcher
    would remove it): removed here, as that launcher would (only those of agents no longer running)."""
    from flashckpt.launch.warm import sweep_modules_dirs

    sweep_modules_dirs()
    _report_deepspeed_build(session)


def pytest_addoption(parser):
    """``--soak N``: run N seeded iterations of the random kill-point test (tests/multiproc/test_killpoints.py).
    ``--extended``: also run the tests marked ``extended`` (left out by default, see ``_EXTENDED``).
    ``--hypothesis-examples N``: N random examples per property test (tests/multiproc/test_roundtrip_property.py)."""
    parser.addoption("--soak", type=int, default=0, metavar="N",
                     help="random kill-point iterations to run (default: a few; FLASHCKPT_SOAK=N does the same)")
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked extended (the adapter x multi-node scenario matrix beyond what "
                          "CI runs; -m extended runs only them)")
    parser.addoption("--hypothesis-examples", type=int, default=0, metavar="N",
                     help="random examples per property test (default: a bounded, derandomized set; "
                          "FLASHCKPT_PROPERTY_EXAMPLES=N does the same)")


# ------------------------------------------------------------------------------------------ test tiers
# Every test file lives in its tier's folder (tests/unit, multiproc, framework, conformance, gpu), whose
# conftest.py marks its tests (tests/support/tiers.py): `pytest tests/unit` or `pytest -m unit` runs in a few
# minutes. A test may carry another tier's marker as well (a multi-rank test in a framework's file is
# `framework` and `multiproc`); `unit` excludes it. A test file outside the tier folders fails the collection.
from tiers import TIERS  # noqa: E402

# Seconds each file's tests took on this 2-core machine (the heaviest; others count 10): a parallel run hands
# the files out heaviest first, so that no long file starts last and runs alone at the end (test_conformance,
# a DeepSpeed file, after test_megatron: DeepSpeed's op, built in the background meanwhile, is ready then).
_FILE_SECONDS = {
    "test_multinode.py": 750, "test_megatron.py": 240, "test_conformance.py": 165, "test_lightning.py": 140,
    "test_process_events.py": 140, "test_dir_moves.py": 125, "test_s3_dist_adapters.py": 120, "test_hf.py": 117,
    "test_killpoints.py": 112, "test_starts_and_leftovers.py": 102, "test_identity.py": 95, "test_native.py": 94,
    "test_fault_injection.py": 92, "test_engine.py": 89, "test_deepspeed.py": 88, "test_lifecycle.py": 87,
    "test_s3_engine.py": 79, "test_fidelity.py": 69, "test_documented_api.py": 63, "test_dlrover_guide.py": 63,
    "test_launcher.py": 62, "test_norename_storage.py": 57, "test_promises.py": 54, "test_hf_s3.py": 53,
    "test_elastic.py": 50,
}
# What `--extended` adds (not run by default, so not in CI): the multi-node scenarios under more adapters and
# variants than CI's, each scenario of which CI runs at least once (with DDP or FSDP), and the four-node loss
# of a whole backup pair (CI runs the four-node loss the partners survive; its plan, memory left to storage
# naming the ranks, is test_replica.py::test_a_whole_group_lost_leaves_memory_to_storage_and_names_the_ranks);
# a background build of the C++ fast path waited for to its end (a minute of a core: CI builds it once before
# the tests, and test_native.py starts one in the background and stops it); Megatron-LM's torch_dist format on
# one rank (CI runs it on two) and its legacy torch format on S3 (CI runs torch_dist on S3, torch locally); the
# elastic scenarios beyond FSDP's 2 -> 1 (DDP 2 -> 1, FSDP 4 -> 3 -> 4, a whole pair lost: its rule is
# test_reshard_plan.py's, and the one-node 2 -> 4 -> 2 is test_fsdp.py's).
_EXTENDED = {
    "test_native.py::test_a_background_build_is_loaded_once_done",
    "test_megatron.py::test_megatron_lm_save_and_load_checkpoint[torch_dist-1]",
    "test_s3_dist_adapters.py::test_megatron_lm_on_s3[torch]",
    "test_multinode.py::test_node_lost_fresh_node_joins_resumes_from_memory[deepspeed]",
    "test_multinode.py::test_node_lost_fresh_node_joins_resumes_from_memory[megatron]",
    "test_multinode.py::test_node_lost_fresh_node_joins_resumes_from_memory[megatron-distopt]",
    "test_multinode.py::test_worker_crash_on_one_node_resumes_from_memory[fsdp]",
    "test_multinode.py::test_sigterm_to_an_agent_commits_the_newest_snapshot[fsdp]",
    "test_multinode.py::test_rank0_node_lost_survivor_commits_and_resumes[fsdp]",
    "test_multinode.py::test_four_nodes_whole_pair_lost_falls_back_to_storage",
    "test_multinode.py::test_node_lost_fresh_node_joins_resumes_from_memory[ddp]",
    "test_elastic.py::test_a_node_lost_and_not_replaced_the_survivor_goes_on_from_memory[ddp]",
    "test_elastic.py::test_a_node_lost_and_not_replaced_the_survivor_goes_on_from_memory[megatron-distopt]",
    "test_elastic.py::test_four_nodes_shrink_to_three_then_grow_back_from_memory",
    "test_elastic.py::test_both_nodes_of_a_pair_lost_the_job_shrinks_to_storage_and_says_why",
}


def pytest_collection_modifyitems(config, items):
    extended = config.getoption("extended") or "extended" in (config.getoption("markexpr") or "")
    kept, left = [], []
    for item in items:
        key = f"{os.path.basename(str(item.path))}::{item.name}"
        if key in _EXTENDED:
            item.add_marker("extended")
        (kept if extended or key not in _EXTENDED else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
    items.sort(key=lambda it: -_FILE_SECONDS.get(os.path.basename(str(it.path)), 10))  # stable: files stay in order
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        folder = os.path.relpath(os.path.dirname(str(item.path)), here)
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.path}: a test file lives in one of the tier folders tests/"
                                    f"{{{','.join(TIERS)}}} (each folder's conftest.py marks its tests)")

