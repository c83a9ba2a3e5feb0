"""Environment knobs, job identity and rank discovery, read in one place."""

from __future__ import annotations

import enum
import hashlib
import os
import tempfile
from dataclasses import dataclass

__all__ = ["StorageType", "Knobs", "RankInfo", "job_key", "runtime_root", "job_dir", "make_private_dir",
           "is_default_runtime_dir", "is_job_key_of"]


class StorageType(enum.Enum):
    """Where a checkpoint goes: MEMORY (host shared memory only) or DISK (memory, then persisted)."""

    MEMORY = "memory"
    MEM = "memory"  # alias of MEMORY
    DISK = "disk"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from e


def _env_int(name: str, default: int) -> int:
    return int(_env_float(name, float(default)))


@dataclass(frozen=True)
class Knobs:
    """Every environment variable flashckpt reads.

    Attributes:
        runtime_dir: parent of the per-job runtime dirs (segments, socket, locks); FLASHCKPT_RUNTIME_DIR.
        shm_limit_bytes: pretend /dev/shm has at most this many free bytes (0 = real); FLASHCKPT_SHM_LIMIT_BYTES.
        grace_s: how long a saver with no clients keeps snapshots for a restarted trainer; FLASHCKPT_SAVER_GRACE_S.
        copy_threads: threads that copy tensors into shared memory; FLASHCKPT_COPY_THREADS.
        slots: snapshot slots per segment (1 or 2); FLASHCKPT_SLOTS. Two come with a spare third slot
            whose memory is reserved only while a persist holds one slot and the other holds the newest
            snapshot, so a snapshot neither waits for a persist nor overwrites the newest complete one
            (up to 3x the state in /dev/shm while a persist runs; when /dev/shm cannot hold the spare
            the snapshot waits for the persist). One slot holds 1x: a kill mid-copy loses the snapshot.
        commit_timeout_s: how long a committing saver waits for the other ranks' files; FLASHCKPT_COMMIT_TIMEOUT_S.
        rpc_timeout_s: bound on one control round trip to the saver; FLASHCKPT_RPC_TIMEOUT_S.
        spawn_timeout_s: bound on starting the saver daemon; FLASHCKPT_SPAWN_TIMEOUT_S.
        last_words: persist the newest snapshot when a trainer dies or on SIGTERM; FLASHCKPT_LAST_WORDS (1/0).
        term_timeout_s: bound on the last-words persist after SIGTERM; FLASHCKPT_TERM_TIMEOUT_S.
        persist_nice: how much lower the saver's persist threads run than training (Linux nice
            increment, 0-19; 0 = the same); FLASHCKPT_PERSIST_NICE. Persisting is background work: where
            host cores are short, training gets them first.
    """

    runtime_dir: str
    shm_limit_bytes: int
    grace_s: float
    copy_threads: int
    slots: int
    commit_timeout_s: float
    rpc_timeout_s: float
    spawn_timeout_s: float
    last_words: bool = True
    term_timeout_s: float = 120.0
    persist_nice: int = 10

    @staticmethod
    def from_env() -> Knobs:
        try:
            ncpu = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            ncpu = os.cpu_count() or 1
        return Knobs(
            runtime_dir=os.environ.get("FLASHCKPT_RUNTIME_DIR") or runtime_root(),
            shm_limit_bytes=_env_int("FLASHCKPT_SHM_LIMIT_BYTES", 0),
            grace_s=_env_float("FLASHCKPT_SAVER_GRACE_S", 600.0),
            copy_threads=max(1, _env_int("FLASHCKPT_COPY_THREADS", min(ncpu, 8))),
            slots=max(1, min(2, _env_int("FLASHCKPT_SLOTS", 2))),
            commit_timeout_s=_env_float("FLASHCKPT_COMMIT_TIMEOUT_S", 1800.0),
            rpc_timeout_s=_env_float("FLASHCKPT_RPC_TIMEOUT_S", 120.0),
            spawn_timeout_s=_env_float("FLASHCKPT_SPAWN_TIMEOUT_S", 60.0),
            last_words=os.environ.get("FLASHCKPT_LAST_WORDS", "1").lower() not in ("0", "false", "no", "off"),
            term_timeout_s=_env_float("FLASHCKPT_TERM_TIMEOUT_S", 120.0),
            persist_nice=max(0, min(19, _env_int("FLASHCKPT_PERSIST_NICE", 10))),
        )


def runtime_root() -> str:
    """The per-user parent dir of job runtime dirs: on /dev/shm when it exists, so segments are RAM."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"flashckpt-{os.getuid()}")


def job_key(checkpoint_dir: str) -> str:
    """Names a job's runtime dir: FLASHCKPT_JOB_ID, else TORCHELASTIC_RUN_ID, plus a hash of the dir.

    The hash of the absolute checkpoint dir is always part of the key, so two engines with different
    checkpoint dirs never share a saver, even inside one job.
    """
    digest = hashlib.sha256(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:_DIGEST_LEN]
    job = os.environ.get("FLASHCKPT_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
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


def make_private_dir(path: str) -> None:
    """Creates the job dir ``path`` with mode 0700 (owner only), and its parent if missing (0700 too).

    An existing parent is left as it is (it may be a shared directory the user chose, like /tmp): the
    job dir itself is what keeps other users out. A job dir owned by another user is refused."""
    parent = os.path.dirname(path)
    os.makedirs(os.path.dirname(parent) or "/", exist_ok=True)
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        pass
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.stat(path)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user; "
                                  "set FLASHCKPT_RUNTIME_DIR to a directory of your own") from None
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)


def is_default_runtime_dir(path: str) -> bool:
    """Whether ``path`` is the per-user root flashckpt chose itself (and so may remove when empty)."""
    return os.path.abspath(path) == os.path.abspath(runtime_root())


def job_dir(checkpoint_dir: str, knobs: Knobs | None = None) -> str:
    knobs = knobs or Knobs.from_env()
    return os.path.join(knobs.runtime_dir, job_key(checkpoint_dir))


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @staticmethod
    def current() -> RankInfo:
        """From torch.distributed when it is initialized, else from torchrun's environment, else 1 rank."""
        import torch.distributed as dist

        env = os.environ
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        # Without torchrun's variables all ranks are taken to be on one node.
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", 0)))
        return RankInfo(rank, world, local_rank, local_world, node_rank)
