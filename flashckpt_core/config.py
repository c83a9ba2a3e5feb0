"""Environment knobs, job identity and rank discovery, read in one place."""

from __future__ import annotations

import enum
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass

from . import errors as E

__all__ = ["StorageType", "Knobs", "RankInfo", "job_key", "runtime_root", "job_dir", "make_private_dir",
           "open_private_dir", "dir_identity", "is_default_runtime_dir", "is_job_key_of", "job_key_digest"]


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
        raise E.InvalidArgumentError(f"environment variable {name}={raw!r} is not a number") from e


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
        persist_worker_idle_s: how long the saver's persist worker (the process that writes the files,
            and the only one that loads torch: ~250 MB) stays after its last persist; the next persist
            starts a new one (1-2 s); FLASHCKPT_PERSIST_WORKER_IDLE_S.
        spare_hold_s: how long a segment's spare snapshot slot stays reserved after the last persist
            that needed it held a slot (0: given back as soon as no persist holds a slot). Reserving it
            again costs a first touch of fresh shared memory (~0.8 s per GB here), so with persists
            every few steps it is kept; a full /dev/shm (an allocation that does not fit) takes it back
            at once. FLASHCKPT_SPARE_HOLD_S.
        scratch_dir: where the adapters stage a snapshot's files for a framework that reads or writes a
            directory (the HF Trainer, Lightning, DeepSpeed), unless their own ``scratch_dir`` says
            otherwise ("": /dev/shm when writable, else the system temp dir); FLASHCKPT_SCRATCH_DIR.
        records_timeout_s: bound on waiting for the saver's start-up work on the commit records (see
            ``saver/housekeeping``) before a load, a persist or a commit says why it cannot go on;
            FLASHCKPT_RECORDS_TIMEOUT_S.
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
    persist_worker_idle_s: float = 30.0
    spare_hold_s: float = 60.0
    scratch_dir: str = ""
    records_timeout_s: float = 300.0

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
            persist_worker_idle_s=max(0.0, _env_float("FLASHCKPT_PERSIST_WORKER_IDLE_S", 30.0)),
            spare_hold_s=max(0.0, _env_float("FLASHCKPT_SPARE_HOLD_S", 60.0)),
            scratch_dir=os.environ.get("FLASHCKPT_SCRATCH_DIR", ""),
            records_timeout_s=max(0.0, _env_float("FLASHCKPT_RECORDS_TIMEOUT_S", 300.0)),
        )


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
    from .errors import SaverError

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
