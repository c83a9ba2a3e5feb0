"""Environment knobs and the job's identity, read in one place.

``Knobs`` holds every ``FLASHCKPT_*`` variable flashckpt reads (with ``ReplicaKnobs`` and ``S3Knobs``), each
with its default and parser; ``knob`` reads one. The job's identity follows from them and the checkpoint
dir: its job key, its private runtime dir (``job_dir``) and the checks that keep that dir this user's.
Where a process sits in the job (rank, world size) is ``engine.ranks.RankInfo``. Imports only ``errors``;
everything here may be called from any thread.

One concept, so one module (~510 lines): the table of every knob flashckpt reads (``Knobs``, the test
of that promise reads this module) and the job identity derived from them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

from flashckpt import errors as E

__all__ = ["StorageType", "Knobs", "ReplicaKnobs", "S3Knobs", "knob", "knob_variables", "JOB_ID_ENV", "AGENT_PID_ENV",
           "LAST_WORDS_ENV", "WARM_MODULES_DIR_ENV", "STORAGE_OPTIONS_ENV",
           "LOCAL_DIR_ENV", "LOCAL_KEEP_ENV", "job_key", "runtime_root", "job_dir", "make_private_dir",
           "open_private_dir", "dir_identity", "is_default_runtime_dir", "is_job_key_of", "is_job_key_of_dir", "job_key_digest"]


class StorageType(enum.Enum):
    """Where a checkpoint goes: MEMORY (host shared memory only) or DISK (memory, then persisted)."""

    MEMORY = "memory"
    MEM = "memory"  # alias of MEMORY
    DISK = "disk"


#: variables flashckpt sets for the processes it starts (and reads back there, as fields below)
JOB_ID_ENV = "FLASHCKPT_JOB_ID"
AGENT_PID_ENV = "FLASHCKPT_AGENT_PID"
LAST_WORDS_ENV = "FLASHCKPT_LAST_WORDS"
WARM_MODULES_DIR_ENV = "FLASHCKPT_WARM_MODULES_DIR"
STORAGE_OPTIONS_ENV = "FLASHCKPT_STORAGE_OPTIONS"
LOCAL_DIR_ENV = "FLASHCKPT_LOCAL_DIR"
LOCAL_KEEP_ENV = "FLASHCKPT_LOCAL_KEEP"

_T = TypeVar("_T")
#: how a knob's value is read from its variable's text (never empty): (variable, text) -> value
Parse = Callable[[str, str], Any]
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError as e:
        raise E.InvalidArgumentError(f"environment variable {name}={raw!r} is not a number") from e


def _float(lo: float | None = None, hi: float | None = None, *, refuse: bool = False) -> Parse:
    """A number, clamped to [lo, hi] (or, when ``refuse``, refused outside it)."""
    def parse(name: str, raw: str) -> float:
        v = _number(name, raw)
        bounded = min(hi, v) if hi is not None else v
        bounded = max(lo, bounded) if lo is not None else bounded
        if refuse and bounded != v:
            raise E.InvalidArgumentError(f"environment variable {name}={raw!r} is out of range (at least {lo}"
                                         + (f", at most {hi})" if hi is not None else ")"))
        return bounded
    return parse


def _int(lo: int | None = None, hi: int | None = None, *, refuse: bool = False) -> Parse:
    """An integer (a number, truncated), clamped to [lo, hi] (or refused outside it when ``refuse``)."""
    num = _float(lo, hi, refuse=refuse)
    return lambda name, raw: int(num(name, raw))


def _flag(name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _OFF + _ON:
        return word in _ON
    raise E.InvalidArgumentError(f"environment variable {name}={raw!r}: use 1 or 0 (true/false, yes/no, on/off)")


def _text(name: str, raw: str) -> str:
    return raw


def _word(*choices: str, aliases: dict[str, str] | None = None, fallback: str | None = None) -> Parse:
    """One of ``choices`` (case and spaces ignored; ``aliases`` map other words to them); anything else is
    ``fallback`` when there is one, else refused."""
    def parse(name: str, raw: str) -> str:
        word = raw.strip().lower()
        word = (aliases or {}).get(word, word)
        if word in choices:
            return word
        if fallback is not None:
            return fallback
        raise E.InvalidArgumentError(f"environment variable {name}={raw!r}: use {', '.join(choices)}")
    return parse


def _json_object(name: str, raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise E.InvalidArgumentError(f"environment variable {name} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise E.InvalidArgumentError(f"environment variable {name} is not a JSON object")
    return value


def _knob(env: str, default: Any, parse: Parse = _text, *, computed: Callable[[], Any] | None = None,
          **kw: Any) -> Any:
    """A field of a knobs dataclass read from the variable ``env`` by ``parse``; unset or empty, it is
    ``computed()`` when given, else ``default``."""
    return field(default=default, metadata={"env": env, "parse": parse, "computed": computed}, **kw)


def _group(cls: type[Any]) -> Any:
    """A field of ``Knobs`` holding another knobs dataclass (a group of variables read together)."""
    return field(default_factory=cls, metadata={"group": cls})


def _read(f: Field[Any]) -> Any:
    env = f.metadata["env"]
    raw = os.environ.get(env)
    if raw is None or raw == "":
        computed = f.metadata["computed"]
        return computed() if computed is not None else f.default
    return f.metadata["parse"](env, raw)


def _from_env(cls: type[_T]) -> _T:
    kw = {f.name: _from_env(f.metadata["group"]) if "group" in f.metadata else _read(f)
          for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**kw)


def _copy_threads_default() -> int:
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        ncpu = os.cpu_count() or 1
    return min(ncpu, 8)


@dataclass(frozen=True)
class ReplicaKnobs:
    """The replica's settings (backups of snapshots to a partner node's memory).

    Attributes:
        mode: "auto" (on for jobs of more than one node), "on", "off" (1/0 too); FLASHCKPT_REPLICA.
        group_size: nodes per backup group (default 2: pairs; >= 1); FLASHCKPT_REPLICA_GROUP_SIZE.
        stride: distance between the nodes of a group (0, the default: nnodes // group size);
            FLASHCKPT_REPLICA_STRIDE.
        mbps: cap on the backup traffic a node sends, MB/s (default 1000; 0: no cap); FLASHCKPT_REPLICA_MBPS.
        host: the address peers reach this node's saver at (default: the one this host routes to
            MASTER_ADDR from, else its host name's); FLASHCKPT_REPLICA_HOST.
        loss_s: how long a commit waits for a rank before it asks whether anyone still writes it, and the
            bound on every question to a peer (default 2 s, at least 0.1); FLASHCKPT_NODE_LOSS_S.
    """

    mode: str = _knob("FLASHCKPT_REPLICA", "auto", _word("auto", "on", "off", aliases={
        **dict.fromkeys(("0", "false", "no"), "off"), **dict.fromkeys(("1", "true", "yes"), "on")}))
    group_size: int = _knob("FLASHCKPT_REPLICA_GROUP_SIZE", 2, _int(1, None, refuse=True))
    stride: int = _knob("FLASHCKPT_REPLICA_STRIDE", 0, _int(0, None, refuse=True))
    mbps: float = _knob("FLASHCKPT_REPLICA_MBPS", 1000.0, _float(0.0))
    host: str = _knob("FLASHCKPT_REPLICA_HOST", "")
    loss_s: float = _knob("FLASHCKPT_NODE_LOSS_S", 2.0, _float(0.1))

    @staticmethod
    def from_env() -> ReplicaKnobs:
        return _from_env(ReplicaKnobs)

    def active(self, nnodes: int) -> bool:
        return self.mode == "on" or (self.mode == "auto" and nnodes > 1)


@dataclass(frozen=True)
class S3Knobs:
    """The S3 backend's options from the environment, ``FLASHCKPT_S3_<FIELD>`` for each field of
    ``flashckpt.storage.s3.options.S3Options`` (which documents them); None: not set (``storage_options`` given
    to the engine win over these, and ``S3Options``' defaults hold for what neither sets).

    Attributes:
        endpoint_url: the store's endpoint; FLASHCKPT_S3_ENDPOINT_URL.
        region: the region; FLASHCKPT_S3_REGION.
        profile: an AWS profile name; FLASHCKPT_S3_PROFILE.
        addressing_style: auto, path or virtual; FLASHCKPT_S3_ADDRESSING_STYLE.
        part_size_mb: multipart part size (>= 5); FLASHCKPT_S3_PART_SIZE_MB.
        concurrency: parts of one file in flight at once; FLASHCKPT_S3_CONCURRENCY.
        max_attempts: attempts per request; FLASHCKPT_S3_MAX_ATTEMPTS.
        deadline_s: a file's transfer gives up after this long; FLASHCKPT_S3_DEADLINE_S.
        read_timeout_s: the longest a request waits without progress; FLASHCKPT_S3_READ_TIMEOUT_S.
        meta_timeout_s: a metadata request without progress for this long is retried;
            FLASHCKPT_S3_META_TIMEOUT_S.
        min_mbps: a data request is retried after meta_timeout_s + part_size_mb / min_mbps s without
            progress; FLASHCKPT_S3_MIN_MBPS.
        checksums: send each part's CRC-32 (1/0); FLASHCKPT_S3_CHECKSUMS.
        conditional_writes: create commit records with If-None-Match (1/0); FLASHCKPT_S3_CONDITIONAL_WRITES.
    """

    endpoint_url: str | None = _knob("FLASHCKPT_S3_ENDPOINT_URL", None)
    region: str | None = _knob("FLASHCKPT_S3_REGION", None)
    profile: str | None = _knob("FLASHCKPT_S3_PROFILE", None)
    addressing_style: str | None = _knob("FLASHCKPT_S3_ADDRESSING_STYLE", None,
                                         _word("auto", "path", "virtual"))
    part_size_mb: int | None = _knob("FLASHCKPT_S3_PART_SIZE_MB", None, _int())
    concurrency: int | None = _knob("FLASHCKPT_S3_CONCURRENCY", None, _int())
    max_attempts: int | None = _knob("FLASHCKPT_S3_MAX_ATTEMPTS", None, _int())
    deadline_s: float | None = _knob("FLASHCKPT_S3_DEADLINE_S", None, _float())
    read_timeout_s: float | None = _knob("FLASHCKPT_S3_READ_TIMEOUT_S", None, _float())
    meta_timeout_s: float | None = _knob("FLASHCKPT_S3_META_TIMEOUT_S", None, _float())
    min_mbps: float | None = _knob("FLASHCKPT_S3_MIN_MBPS", None, _float())
    checksums: bool | None = _knob("FLASHCKPT_S3_CHECKSUMS", None, _flag)
    conditional_writes: bool | None = _knob("FLASHCKPT_S3_CONDITIONAL_WRITES", None, _flag)

    @staticmethod
    def from_env() -> S3Knobs:
        return _from_env(S3Knobs)

    def given(self) -> dict[str, Any]:
        """The options set in the environment, by ``S3Options`` field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Knobs:
    """Every environment variable flashckpt reads: each field names its variable (``knob_variables()``
    lists them all; tests/unit/test_config_knobs.py holds that no other module names one it reads); unset or empty, a variable leaves the default. A bad value raises
    InvalidArgumentError naming the variable. ``Knobs.from_env()`` reads them all at once;
    ``knob(name)`` reads one now (for the knobs read on every call).

    Attributes:
        runtime_dir: parent of the per-job runtime dirs (segments, socket, locks); FLASHCKPT_RUNTIME_DIR.
        shm_limit_bytes: pretend /dev/shm has at most this many free bytes (0 = real); FLASHCKPT_SHM_LIMIT_BYTES.
        grace_s: how long a saver with no clients keeps snapshots for a restarted trainer; FLASHCKPT_SAVER_GRACE_S.
        copy_threads: threads that copy tensors into shared memory (default: the CPUs, at most 8);
            FLASHCKPT_COPY_THREADS.
        slots: snapshot slots per segment (1 or 2); FLASHCKPT_SLOTS. Two come with ``spare_slots`` spare
            slots whose memory is reserved only while persists (or backups to a partner node) hold slots:
            one more per slot held, so that a snapshot neither waits for a persist nor overwrites the
            newest complete one (2x the state in /dev/shm, plus 1x per persist in flight; when /dev/shm
            cannot hold another slot, or every slot is held, the snapshot waits and logs the wait). One
            slot holds 1x: a kill mid-copy loses the snapshot, and a snapshot waits for a persist of it.
        spare_slots: the most spare slots of a two-slot segment (0-16, default 4): snapshots never wait
            while fewer persists than this are in flight for the local rank; FLASHCKPT_SPARE_SLOTS.
        commit_timeout_s: how long a committing saver waits for the other ranks' files; FLASHCKPT_COMMIT_TIMEOUT_S.
        rpc_timeout_s: bound on one control round trip to the saver; FLASHCKPT_RPC_TIMEOUT_S.
        spawn_timeout_s: bound on starting the saver daemon; FLASHCKPT_SPAWN_TIMEOUT_S.
        last_words: persist the newest snapshot (when newer than the last commit) when a trainer ends (a
            crash, ``close()``, an exit) or on SIGTERM; FLASHCKPT_LAST_WORDS (1/0).
        term_timeout_s: bound on the last-words persist after SIGTERM; FLASHCKPT_TERM_TIMEOUT_S.
        persist_nice: how much lower the saver's persist threads run than training (Linux nice
            increment, 0-19; 0 = the same); FLASHCKPT_PERSIST_NICE. Persisting is background work: where
            host cores are short, training gets them first.
        persist_worker_idle_s: how long the saver's persist worker (the process that writes the files,
            and the only one that loads torch: ~250 MB) stays after its last persist; the next persist
            starts a new one (1-2 s); FLASHCKPT_PERSIST_WORKER_IDLE_S.
        spare_hold_s: how long a segment's spare snapshot slots stay reserved after the last persist
            that needed them held a slot (0: given back as soon as no persist holds a slot). Reserving one
            again costs a first touch of fresh shared memory (~0.8 s per GB here), so with persists
            every few steps they are kept; a full /dev/shm (an allocation that does not fit) takes them
            back at once. FLASHCKPT_SPARE_HOLD_S.
        scratch_dir: where the adapters stage a snapshot's files for a framework that reads or writes a
            directory (the HF Trainer, Lightning, DeepSpeed), unless their own ``scratch_dir`` says
            otherwise ("": /dev/shm when writable, else the system temp dir); FLASHCKPT_SCRATCH_DIR.
        records_timeout_s: bound on waiting for the saver's start-up work on the commit records (see
            ``saver/housekeeping``) before a load, a persist or a commit says why it cannot go on;
            FLASHCKPT_RECORDS_TIMEOUT_S.
        job_id: the job the runtime dir is named after (see ``job_key``; else TORCHELASTIC_RUN_ID); set by
            ``flashckpt-run`` for its workers; FLASHCKPT_JOB_ID.
        agent_pid: the pid of the ``flashckpt-run`` launcher this process runs under (0: none), set by it
            for its workers: the savers end once it is gone; FLASHCKPT_AGENT_PID.
        lease_ttl_s: time to live of the commit-records lease of a backend without a local file system
            (at least 1 s); FLASHCKPT_LEASE_TTL_S.
        storage_options: the ``storage_options`` a saver daemon or persist worker was started with (a
            JSON object, set by the process that starts it); FLASHCKPT_STORAGE_OPTIONS.
        saver_log_level: the log level of the saver daemon and its persist worker (a ``logging`` level
            name); FLASHCKPT_SAVER_LOG_LEVEL.
        native: the C++ fast path (``_native``): "auto" (load it if built, else build it in the
            background), "build" (build it now, blocking), 0/off/false/no (never); FLASHCKPT_NATIVE.
        ext_dir: where the fast path's builds are cached ("": ``~/.cache/flashckpt/ext``); FLASHCKPT_EXT_DIR.
        cuda_load: how a restore copies to the GPU (``_cuda``): staged, register or pageable (anything
            else: staged); FLASHCKPT_CUDA_LOAD.
        cuda_register: when a snapshot's slot is page-locked for its device-to-host copies: "background"
            (default: on a thread of its own, the slot's first snapshots going through pinned bounce buffers
            meanwhile, so the training thread never waits for the page-locking) or "inline" (on the training
            thread at the slot's first snapshot); FLASHCKPT_CUDA_REGISTER.
        cuda_unlocked: how a snapshot is copied into a slot whose page-locking still runs: "wait" (default:
            the snapshot thread waits for the lock, then one DMA) or "bounce" (through two pinned bounce
            buffers on that thread; what a slot the driver refuses always takes); FLASHCKPT_CUDA_UNLOCKED.
        cuda_defer: an overlapped snapshot of CUDA tensors that needs a new plan (the first) makes its plan,
            segment and slot claim on the snapshot thread, so its ``save()`` returns as fast as a later one's
            (1/0; default 1); FLASHCKPT_CUDA_DEFER.
        cuda_batch: a snapshot's device copies go to the CUDA runtime as one ``cudaMemcpyBatchAsync`` where the
            runtime is CUDA 13 (1/0; default 1; 0: one ``cudaMemcpyAsync`` a copy, from C++); FLASHCKPT_CUDA_BATCH.
        cuda_prestage: a new engine on a job whose newest snapshot of this rank in memory holds CUDA tensors
            page-locks that snapshot's slot in the background at once, so that ``load()`` copies it to the
            GPU at the PCIe limit (1/0; default 1); FLASHCKPT_CUDA_PRESTAGE.
        launch_events: a file ``flashckpt-run`` (its agent, its warm workers) appends one JSON line per
            event to ("": none); FLASHCKPT_LAUNCH_EVENTS.
        last_words_blocking: ``flashckpt-run`` restarts failed workers only after their last words are
            persisted (default: while they are); FLASHCKPT_LAST_WORDS_BLOCKING (1/0).
        warm_workers: ``flashckpt-run`` hands restarted workers to warm processes (1/0);
            FLASHCKPT_WARM_WORKERS.
        warm_delay_s: how long after a worker's start its warm twin is started; FLASHCKPT_WARM_DELAY_S.
        auto_resume: a worker that ``flashckpt-run`` (or torchrun) restarted after a failure resumes from
            the newest checkpoint by itself (memory first), where the script passes no resume path, in the
            adapters that take one (the HF Trainer's ``train()``, Lightning's ``fit()``); their own
            ``auto_resume`` argument wins over it; FLASHCKPT_AUTO_RESUME (1/0).
        warm_modules_dir: where a worker of ``flashckpt-run`` records the modules it imported for its warm
            twin (set by the launcher); FLASHCKPT_WARM_MODULES_DIR.
        rdzv_poll_s: seconds between a waiting agent's polls of the rendezvous state (None: 0.1 up to 64
            nodes, else 1; at least 0.01); FLASHCKPT_RDZV_POLL_S.
        rdzv_keep_alive_s: the rendezvous heartbeat interval (None: 1 s where the poll is fast, else
            torch's); FLASHCKPT_RDZV_KEEP_ALIVE_S.
        local_dir: the node-local tier of every engine that gives no ``local_dir`` (a directory on a local
            disk or NVMe; "": none): ``save(DISK)`` commits there first and the node's saver uploads each step
            to the checkpoint dir in the background; FLASHCKPT_LOCAL_DIR.
        local_keep: locally committed steps kept per node (0: all; a step not yet uploaded is always kept);
            FLASHCKPT_LOCAL_KEEP.
        on_persist_error: what a failed persist does to training, where ``CheckpointEngine`` is not told:
            "raise" (at the next save or wait) or "warn" (logged, training goes on; see
            ``engine.durability``); FLASHCKPT_ON_PERSIST_ERROR.
        max_lag_s: the bound on how far storage may fall behind the newest snapshot, in seconds (0: none),
            where ``CheckpointEngine`` is not told; FLASHCKPT_MAX_LAG_S.
        unreadable_backoff_s: under "warn", how long saves to storage go to memory at once, owed, after one
            found the checkpoint dir unreadable (a store that is down), before a save asks it again;
            FLASHCKPT_UNREADABLE_BACKOFF_S.
        metrics_file: a file each engine keeps its checkpointing figures in, in Prometheus' text format, for a
            node exporter's textfile collector or any scraper ("": none, the default); ``{rank}`` in it is
            the engine's global rank (one file per rank; without it, local rank 0's engine writes it); see
            ``engine.events``; FLASHCKPT_METRICS_FILE.
        replica: the backups to a partner node (``ReplicaKnobs``): FLASHCKPT_REPLICA*, FLASHCKPT_NODE_LOSS_S.
        s3: the S3 backend's options (``S3Knobs``): FLASHCKPT_S3_*.
    """

    runtime_dir: str = _knob("FLASHCKPT_RUNTIME_DIR", "", computed=lambda: runtime_root())
    shm_limit_bytes: int = _knob("FLASHCKPT_SHM_LIMIT_BYTES", 0, _int())
    grace_s: float = _knob("FLASHCKPT_SAVER_GRACE_S", 600.0, _float())
    copy_threads: int = _knob("FLASHCKPT_COPY_THREADS", 1, _int(1), computed=_copy_threads_default)
    slots: int = _knob("FLASHCKPT_SLOTS", 2, _int(1, 2))
    commit_timeout_s: float = _knob("FLASHCKPT_COMMIT_TIMEOUT_S", 1800.0, _float())
    rpc_timeout_s: float = _knob("FLASHCKPT_RPC_TIMEOUT_S", 120.0, _float())
    spawn_timeout_s: float = _knob("FLASHCKPT_SPAWN_TIMEOUT_S", 60.0, _float())
    last_words: bool = _knob(LAST_WORDS_ENV, True, _flag)
    term_timeout_s: float = _knob("FLASHCKPT_TERM_TIMEOUT_S", 120.0, _float())
    persist_nice: int = _knob("FLASHCKPT_PERSIST_NICE", 10, _int(0, 19))
    persist_worker_idle_s: float = _knob("FLASHCKPT_PERSIST_WORKER_IDLE_S", 30.0, _float(0.0))
    spare_hold_s: float = _knob("FLASHCKPT_SPARE_HOLD_S", 60.0, _float(0.0))
    scratch_dir: str = _knob("FLASHCKPT_SCRATCH_DIR", "")
    records_timeout_s: float = _knob("FLASHCKPT_RECORDS_TIMEOUT_S", 300.0, _float(0.0))
    spare_slots: int = _knob("FLASHCKPT_SPARE_SLOTS", 4, _int(0, 16))
    job_id: str = _knob(JOB_ID_ENV, "")
    agent_pid: int = _knob(AGENT_PID_ENV, 0, _int(0))
    lease_ttl_s: float = _knob("FLASHCKPT_LEASE_TTL_S", 60.0, _float(1.0))
    storage_options: dict[str, Any] | None = _knob(STORAGE_OPTIONS_ENV, None, _json_object, hash=False)
    saver_log_level: str = _knob("FLASHCKPT_SAVER_LOG_LEVEL", "INFO")
    native: str = _knob("FLASHCKPT_NATIVE", "auto", lambda name, raw: raw.strip().lower())
    ext_dir: str = _knob("FLASHCKPT_EXT_DIR", "")
    cuda_load: str = _knob("FLASHCKPT_CUDA_LOAD", "staged", _word("staged", "register", "pageable",
                                                                  fallback="staged"))
    cuda_register: str = _knob("FLASHCKPT_CUDA_REGISTER", "background", _word("background", "inline",
                                                                              fallback="background"))
    cuda_unlocked: str = _knob("FLASHCKPT_CUDA_UNLOCKED", "wait", _word("wait", "bounce", fallback="wait"))
    cuda_defer: bool = _knob("FLASHCKPT_CUDA_DEFER", True, _flag)
    cuda_batch: bool = _knob("FLASHCKPT_CUDA_BATCH", True, _flag)
    cuda_prestage: bool = _knob("FLASHCKPT_CUDA_PRESTAGE", True, _flag)
    launch_events: str = _knob("FLASHCKPT_LAUNCH_EVENTS", "")
    last_words_blocking: bool = _knob("FLASHCKPT_LAST_WORDS_BLOCKING", False, _flag)
    warm_workers: bool = _knob("FLASHCKPT_WARM_WORKERS", True, _flag)
    warm_delay_s: float = _knob("FLASHCKPT_WARM_DELAY_S", 5.0, _float())
    warm_modules_dir: str = _knob(WARM_MODULES_DIR_ENV, "")
    auto_resume: bool = _knob("FLASHCKPT_AUTO_RESUME", True, _flag)
    rdzv_poll_s: float | None = _knob("FLASHCKPT_RDZV_POLL_S", None, _float(0.01))
    local_dir: str = _knob(LOCAL_DIR_ENV, "")
    local_keep: int = _knob(LOCAL_KEEP_ENV, 2, _int(0, refuse=True))
    rdzv_keep_alive_s: float | None = _knob("FLASHCKPT_RDZV_KEEP_ALIVE_S", None, _float())
    on_persist_error: str = _knob("FLASHCKPT_ON_PERSIST_ERROR", "raise", _word("raise", "warn"))
    max_lag_s: float = _knob("FLASHCKPT_MAX_LAG_S", 0.0, _float(0.0))
    unreadable_backoff_s: float = _knob("FLASHCKPT_UNREADABLE_BACKOFF_S", 30.0, _float(0.0))
    metrics_file: str = _knob("FLASHCKPT_METRICS_FILE", "")
    replica: ReplicaKnobs = _group(ReplicaKnobs)
    s3: S3Knobs = _group(S3Knobs)

    @staticmethod
    def from_env() -> Knobs:
        """Every knob, read from the environment now.

        Raises:
            InvalidArgumentError: a variable has a value its knob cannot take (the message names it).
        """
        return _from_env(Knobs)


def knob(name: str) -> Any:
    """The ``Knobs`` field ``name``, read from the environment now (the knobs read on every call, so that a
    change of the environment, e.g. by a test, is seen at once).

    Raises:
        InvalidArgumentError: its variable has a value the knob cannot take.
    """
    f = _KNOB_FIELDS[name]
    return _from_env(f.metadata["group"]) if "group" in f.metadata else _read(f)


def knob_variables() -> list[tuple[str, str]]:
    """Every environment variable flashckpt reads, with the dotted ``Knobs`` field it sets (``"replica.mode"``),
    in the order ``Knobs`` declares them."""
    def walk(cls: type[Any], prefix: str) -> Iterator[tuple[str, str]]:
        for f in fields(cls):
            if "group" in f.metadata:
                yield from walk(f.metadata["group"], f"{prefix}{f.name}.")
            else:
                yield f.metadata["env"], prefix + f.name
    return list(walk(Knobs, ""))


_KNOB_FIELDS = {f.name: f for f in fields(Knobs)}


def runtime_root() -> str:
    """The per-user parent dir of job runtime dirs: on /dev/shm when it exists, so segments are RAM."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"flashckpt-{os.getuid()}")


def job_key_digest(checkpoint_dir: str) -> str:
    """The part of every job key of ``checkpoint_dir`` that names the dir: a hash of its absolute path,
    with symbolic links resolved for a local dir (a dir reached through a link and through its real path
    is one job's, with one saver and one memory)."""
    path = checkpoint_dir if "://" in checkpoint_dir else os.path.realpath(checkpoint_dir)
    return hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:_DIGEST_LEN]


def job_key(checkpoint_dir: str) -> str:
    """Names a job's runtime dir: FLASHCKPT_JOB_ID, else TORCHELASTIC_RUN_ID, plus a hash of the dir.

    The hash of the absolute checkpoint dir is always part of the key, so two engines with different
    checkpoint dirs never share a saver, even inside one job.
    """
    digest = job_key_digest(checkpoint_dir)
    job = knob("job_id") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
    if job in ("", "none"):
        return digest
    return f"{_safe_job_id(job)}-{digest}"


_DIGEST_LEN = 10
_HEX = frozenset("0123456789abcdef")


def _safe_job_id(job: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:40]


def is_job_key_of(name: str, job_id: str) -> bool:
    """Whether ``name`` is a job key ``job_key`` gives for ``job_id`` (any checkpoint dir). Exact: the
    savers of job ``<job id>-eval`` are not those of ``<job id>``."""
    prefix = _safe_job_id(job_id) + "-"
    digest = name[len(prefix):]
    return name.startswith(prefix) and len(digest) == _DIGEST_LEN and set(digest) <= _HEX


def is_job_key_of_dir(name: str, digest: str) -> bool:
    """Whether ``name`` is a job key ``job_key`` gives for the checkpoint dir whose ``job_key_digest`` is
    ``digest`` (any job id): the runtime dirs of that dir's jobs on this node."""
    return name == digest or name.endswith("-" + digest)


def make_private_dir(path: str) -> None:
    """Creates or checks the job dir ``path`` and its parent, the runtime dir (see ``open_private_dir``)."""
    os.close(open_private_dir(path))


def open_private_dir(path: str) -> int:
    """Creates the job dir ``path`` with mode 0700, and its parent (the runtime dir) when missing (0700
    too); checks both and returns an fd of the job dir, which the caller closes.

    No symbolic link is followed at either level, and each check is made with ``fstat`` on the
    ``O_NOFOLLOW`` fd that is then used, so nothing swapped in between can pass. The job dir must be a
    directory owned by this user (its mode is set to 0700). The runtime dir must be one that no other
    user can change: the per-user root flashckpt chose itself (``runtime_root()``) must be owned by this
    user (its mode is set to 0700); one the user chose (FLASHCKPT_RUNTIME_DIR) may also be owned by
    root, and writable by others only when sticky (like /tmp).

    Raises:
        SaverError: either dir is a symbolic link, is not a directory, belongs to another user, or (the
            runtime dir) may be changed by another user; the message says what to do.
    """
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(os.path.dirname(parent) or "/", exist_ok=True)
    pfd = _open_dir(parent, None, parent, "root" if is_default_runtime_dir(parent) else "chosen")
    try:
        return _open_dir(name, pfd, path, "job")
    finally:
        os.close(pfd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FIX = ("remove it (if another user owns it, ask them or an administrator) or set FLASHCKPT_RUNTIME_DIR to a "
        "directory of your own")


def _open_dir(name: str, dir_fd: int | None, shown: str, level: str) -> int:
    """Opens ``name`` (in ``dir_fd``), creating it 0700 when missing, and checks it: ``level`` "job" is
    a job dir, "root" the per-user root flashckpt chose, "chosen" a runtime dir the user chose."""
    from flashckpt.errors import SaverError

    for _ in range(10):
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            break
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o700, dir_fd=dir_fd)
            except FileExistsError:
                pass  # another process created it at this instant: open and check it on the next round
        except OSError as e:  # ELOOP: a symbolic link; ENOTDIR; EACCES: another user's private dir
            raise SaverError(f"flashckpt's runtime dir {shown} {_what_is(shown, e)}; {_FIX}") from e
    else:
        raise SaverError(f"flashckpt's runtime dir {shown} vanished each time it was created; {_FIX}")
    try:
        st = os.fstat(fd)
        uid = os.getuid()
        if level != "chosen":
            if st.st_uid != uid:
                raise SaverError(f"flashckpt's runtime dir {shown} belongs to uid {st.st_uid}, not to this user "
                                 f"(uid {uid}), who must own it alone; {_FIX}")
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.fchmod(fd, 0o700)
        elif st.st_uid not in (uid, 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise SaverError(f"flashckpt's runtime dir {shown} (FLASHCKPT_RUNTIME_DIR) belongs to uid "
                             f"{st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, so another user could replace "
                             "what flashckpt keeps there; set FLASHCKPT_RUNTIME_DIR to a directory of your own "
                             "(or to a sticky one of root's, like /tmp)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _what_is(path: str, e: OSError) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return f"cannot be opened ({e})"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (owned by uid {st.st_uid}), which flashckpt never follows"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return f"cannot be opened ({e}); it belongs to uid {st.st_uid}"


def is_default_runtime_dir(path: str) -> bool:
    """Whether ``path`` is the per-user root flashckpt chose itself (and so may remove when empty)."""
    return os.path.abspath(path) == os.path.abspath(runtime_root())


def dir_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the directory at ``path``; None when there is none. A job's runtime dir removed (by
    systemd-logind's RemoveIPC, a tmp cleaner) or replaced since it was recorded has another identity: the
    one test, on both sides (engine and saver), that its shared memory is gone."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def job_dir(checkpoint_dir: str, knobs: Knobs | None = None) -> str:
    knobs = knobs or Knobs.from_env()
    return os.path.join(knobs.runtime_dir, job_key(checkpoint_dir))
