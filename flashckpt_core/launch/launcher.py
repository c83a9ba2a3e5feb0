"""``flashckpt-run``: torchrun with last-words persistence.

Same arguments and behaviour as ``torchrun`` (it is ``torch.distributed.run`` with its parser, its
rendezvous and its ``LocalElasticAgent``), plus:

- whenever the agent stops its workers (a worker failed and the group is restarted, or restarts are
  exhausted), it first has the node's savers persist and commit the newest snapshot every rank holds,
  when that is newer than the last commit; restarted workers then load it from memory;
- on SIGTERM/SIGINT it does the same within ``--term-timeout`` seconds, then exits;
- ``--no-last-words`` turns both off (and the savers' own last words after a trainer crash);
- every restart round comes up: with torchrun's static rendezvous (``--master_port``, no
  ``--rdzv-backend``) torch hands each round the store the previous round's workers wrote into, and a
  restarted gloo group then reads dead peers' addresses (``Gloo connectFullMesh failed ... Connection
  refused``, or a hang); from the first restart on, each round's workers get a store of their own
  (``_store_of_round``);
- its workers never outlive it: they (and the warm workers) are started with ``PR_SET_PDEATHSIG``
  (``flashckpt.util.pdeathsig``), so a launcher killed with SIGKILL takes them with it, where torchrun leaves
  them running as orphans.

Before a restart the last words run beside it, not before it: the restarted workers load the newest
snapshot from memory whether or not its commit has finished, so the restart need not wait for the
persist (it is waited for before the launcher exits; ``FLASHCKPT_LAST_WORDS_BLOCKING=1`` restarts only
after it, as before). ``FLASHCKPT_LAUNCH_EVENTS=<file>`` appends one JSON
line per agent event (a failure noticed, workers stopped, last words done, rendezvous done, workers
started; wall-clock ``t``), which ``benchmarks/bench_recovery.py`` uses for its breakdown.

Restarted workers start warm (``flashckpt.launch.warm``): after starting a worker the agent keeps a second
process per local rank ready, with the same interpreter, options and environment and torch, flashckpt and
the script's library imports done; a restart hands each rank's worker to it instead of starting a new
interpreter, when nothing but the rendezvous endpoint and attempt counter differ (else a new process, as
torchrun starts). ``--no-warm-workers`` / ``FLASHCKPT_WARM_WORKERS=0`` turn this off;
``FLASHCKPT_WARM_DELAY_S`` (default 5) is how long after a worker's start its warm twin is started.

The savers are the per-node daemons the engines start (the same path as under plain ``torchrun``); the
launcher gives every worker one ``FLASHCKPT_JOB_ID`` so restarted workers find them again: the one set in
its environment, else the rendezvous id (``--rdzv-id``, the same on every node and every restart of the
launcher, so a restarted launcher's workers re-attach to the savers and their snapshots), else (with
``--standalone`` or no rendezvous id) a random id, unique to this launch. It also gives them its pid
(``FLASHCKPT_AGENT_PID``): the savers watch it and, once the launcher is gone and no worker is left,
persist what is newer than the last commit and exit instead of waiting out their grace period.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from typing import Any

from flashckpt import errors as E
from flashckpt.config import (
    AGENT_PID_ENV,
    JOB_ID_ENV,
    LAST_WORDS_ENV,
    LOCAL_DIR_ENV,
    LOCAL_KEEP_ENV,
    WARM_MODULES_DIR_ENV,
    Knobs,
    is_job_key_of,
    knob,
)
from flashckpt.launch.warm import launch_event
from flashckpt.transport import messages as M
from flashckpt.transport.wire import Client

__all__ = ["main", "last_words_for_job"]

log = logging.getLogger(__name__)


def _job_dirs(job_id: str, knobs: Knobs) -> list[str]:
    try:
        names = os.listdir(knobs.runtime_dir)
    except FileNotFoundError:
        return []
    return [os.path.join(knobs.runtime_dir, n) for n in names if is_job_key_of(n, job_id)]


def last_words_for_job(job_id: str, timeout: float) -> dict[str, Any]:
    """Asks every saver of ``job_id`` on this node to persist and commit its newest snapshot.

    Returns:
        job dir -> the step persisted (None when memory held nothing newer than the last commit),
        or the error message when that saver could not do it.
    """
    knobs = Knobs.from_env()
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    for d in _job_dirs(job_id, knobs):
        sock = os.path.join(d, "saver.sock")
        if not os.path.exists(sock):
            continue
        left = max(1.0, deadline - time.monotonic())
        try:
            client = Client(sock, timeout=left)
        except OSError:
            continue  # no saver behind it (stale); `flashckpt gc` reclaims it
        except E.SaverError as e:  # served by another uid: nothing was sent to it
            out[d] = f"error: {e}"
            continue
        try:
            out[d] = client.request(M.LastWords(timeout_s=left), timeout=left + 5).step
        except E.FlashCheckpointError as e:
            out[d] = f"error: {e}"
        finally:
            client.close()
    for d, step in out.items():
        said = ("nothing left to persist: its newest snapshot in memory is committed already (a saver also "
                "does this on its own as soon as it sees a trainer die)" if step is None else
                f"step {step}, its newest snapshot in memory, goes to storage and is committed" if isinstance(step, int)
                else str(step))
        log.warning("last words of job %s (its saver persists and commits the newest snapshot in memory that "
                    "storage lacks): %s", os.path.basename(d), said)
    return out


_pending: list[threading.Thread] = []  # last words running beside a restart


def _say_last_words(job_id: str, timeout: float) -> None:
    last_words_for_job(job_id, timeout)
    launch_event("last_words_done")


def _join_last_words(timeout: float) -> None:
    """Waits for the last words started beside a restart (before new ones, and before the launcher exits)."""
    while _pending:
        _pending.pop().join(timeout + 10)


def _flash_agent_class(base: type, job_id: str, timeout: float, enabled: bool) -> type:
    class FlashElasticAgent(base):
        """LocalElasticAgent that persists the newest snapshot whenever it stops its workers: beside the
        restart when it restarts them, before it goes on otherwise."""

        _restarting = False

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state.name in ("FAILED", "UNHEALTHY"):
                launch_event("failure_noticed", state=result.state.name)
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            self._restarting = True
            try:
                super()._restart_workers(worker_group)
            finally:
                self._restarting = False

        def _stop_workers(self, worker_group: Any, *args: Any, **kwargs: Any) -> None:
            super()._stop_workers(worker_group, *args, **kwargs)
            launch_event("workers_stopped")
            if not enabled:
                return
            _join_last_words(timeout)
            if self._restarting and not knob("last_words_blocking"):
                t = threading.Thread(target=_say_last_words, args=(job_id, timeout), name="flashckpt-last-words",
                                     daemon=True)
                _pending.append(t)
                t.start()
            else:
                _say_last_words(job_id, timeout)

        _rounds = 0  # rendezvous rounds so far (the first starts the workers, each later one restarts them)
        _round_store: Any = None  # the TCPStore of this round's workers, when this agent hosts one

        def _rendezvous(self, worker_group: Any) -> None:
            super()._rendezvous(worker_group)
            self._round_store = _store_of_round(worker_group, self._rounds, self._round_store)
            self._rounds += 1
            launch_event("rendezvous_done")

        def _start_workers(self, worker_group: Any) -> Any:
            ids = super()._start_workers(worker_group)
            launch_event("workers_started")
            return ids

    return FlashElasticAgent


def _store_of_round(worker_group: Any, round_: int, previous: Any) -> Any:
    """Gives the workers of a restart round a store of their own (returns the one this agent hosts).

    Where the workers use the agent's store (``use_agent_store``: the static rendezvous of ``torchrun
    --master_port P``, without ``--standalone`` or ``--rdzv-backend``), torch hands every round the same
    TCPStore, still holding the keys the previous round's workers wrote: gloo's pair addresses among
    them, so a restarted rank reads a dead peer's address and fails with ``Gloo connectFullMesh failed
    ... Connection refused``, or hangs (2 restarts in 3 under plain torchrun). From the first restart on,
    the agent of group rank 0 hosts a new TCPStore on a port the kernel picks (no race for a free port)
    and the workers get its port as MASTER_PORT; the previous round's store closes with it. Other nodes
    read the port from the rendezvous store (the key names the round: a static rendezvous restarts every
    node once per failure). The first round is torchrun's. A dynamic rendezvous (``c10d``) gives each
    round a store of its own already (flashckpt-run sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1); one that
    shares its store across nodes (set to 0) keeps torch's behaviour: its nodes count rounds apart."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    handler = worker_group.spec.rdzv_handler
    if round_ == 0 or not handler.use_agent_store:
        return previous
    if worker_group.group_world_size > 1 and handler.get_backend() != "static":
        return previous
    key = f"flashckpt/round_{round_}/worker_store_port"
    store = None
    if worker_group.group_rank == 0:
        store = TCPStore(worker_group.master_addr, 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=900), multi_tenant=True)
        port = int(store.port)
        if worker_group.group_world_size > 1:
            worker_group.store.set(key, str(port))
    else:
        port = int(worker_group.store.get(key).decode())
    log.info("restart round %d: the workers use a new store at %s:%d", round_, worker_group.master_addr, port)
    worker_group.master_port = port
    return store


def _job_id_of(args: Any) -> str:
    """The job id of a launch without FLASHCKPT_JOB_ID: its rendezvous id, else a random one.

    ``--standalone`` (and a single-node static rendezvous) get a random rendezvous id from torchrun, and
    two such launches may run side by side on one node: they must not share savers, so they get a random
    job id too; their savers end with the launcher (FLASHCKPT_AGENT_PID)."""
    rdzv = str(getattr(args, "rdzv_id", "") or "")
    if getattr(args, "standalone", False) or rdzv in ("", "none"):
        return f"run-{uuid.uuid4().hex[:12]}"
    return rdzv


def _rendezvous_poll(args: Any) -> float:
    """Seconds between a waiting agent's polls of the rendezvous state (FLASHCKPT_RDZV_POLL_S): torch's
    dynamic rendezvous waits 1 s between polls, and caches the state it read for 1 s, to spare the backend
    at scale, which makes a multi-node restart wait 1-2 s for the agents that joined first. Up to 64 nodes 0.1 s (640 store
    reads a second at most, while a rendezvous is open); beyond that torch's 1 s."""
    poll_s: float | None = knob("rdzv_poll_s")
    if poll_s is not None:
        return poll_s
    max_nodes = str(getattr(args, "nnodes", "1")).split(":")[-1]
    return 0.1 if max_nodes.isdigit() and int(max_nodes) <= 64 else 1.0


def _rendezvous_keep_alive(args: Any) -> None:
    """Detects a lost node in seconds: torch's dynamic rendezvous counts a node dead after
    ``keep_alive_max_attempt`` (3) missed heartbeats ``keep_alive_interval`` (5 s) apart, and a restart whose
    group lost a node waits that long (15 s) before a fresh node takes its place. Up to 64 nodes
    (as ``_rendezvous_poll``) flashckpt-run beats every ``FLASHCKPT_RDZV_KEEP_ALIVE_S`` (1 s): 3 s to
    detect. What ``--rdzv-conf`` sets is kept."""
    if getattr(args, "rdzv_backend", "") in ("", "static") or getattr(args, "standalone", False):
        return
    conf = str(getattr(args, "rdzv_conf", "") or "")
    keys = {kv.split("=", 1)[0].strip() for kv in conf.split(",") if "=" in kv}
    interval: float | None = knob("rdzv_keep_alive_s")
    if interval is None:
        if _rendezvous_poll(args) > 0.5:
            return
        interval = 1.0
    add = [f"keep_alive_interval={max(1, round(interval))}"] if "keep_alive_interval" not in keys else []
    if "keep_alive_max_attempt" not in keys:
        add.append("keep_alive_max_attempt=3")
    if add:
        args.rdzv_conf = ",".join([c for c in [conf] if c] + add)


def _poll_rendezvous_every(poll_s: float) -> None:
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dr

    delay = dr._delay

    def _delay(seconds: float | tuple[float, float]) -> None:
        # the 1 s before a waiting agent's next poll (dr._DistributedRendezvousOpExecutor.run, _Action.SYNC)
        delay(poll_s if seconds == 1 else seconds)

    dr._delay = _delay  # only this launcher process is affected
    # and the rendezvous state it reads is cached for 1 s (a poll within that does not read the backend)
    holder = dr._BackendRendezvousStateHolder
    init = holder.__init__

    def __init__(self: Any, backend: Any, settings: Any, cache_duration: float = 1) -> None:
        init(self, backend, settings, min(cache_duration, poll_s))  # type: ignore[arg-type]

    holder.__init__ = __init__  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.launcher.api as launcher_api
    import torch.distributed.run as tdr
    from torch.distributed.elastic.multiprocessing.api import SignalException

    parser = tdr.get_args_parser()
    parser.description = "flashckpt-run: torchrun that persists the newest in-memory snapshot before " \
                         "restarting failed workers and on SIGTERM. " + (parser.description or "")
    parser.add_argument("--no-last-words", "--no_last_words", action="store_true",
                        help="do not persist the newest snapshot on worker failure or SIGTERM")
    parser.add_argument("--no-warm-workers", "--no_warm_workers", action="store_true",
                        help="start restarted workers as new processes (default: hand them to warm ones)")
    parser.add_argument("--term-timeout", "--term_timeout", type=float, default=120.0,
                        help="seconds allowed for persisting the newest snapshot after SIGTERM (default 120)")
    parser.add_argument("--local-dir", "--local_dir", default=None,
                        help="a node-local directory (NVMe, a local disk) as every worker's local tier: save(DISK) "
                             "commits there first and the node's saver uploads each step to the checkpoint dir in "
                             "the background (sets FLASHCKPT_LOCAL_DIR for the workers)")
    parser.add_argument("--local-keep", "--local_keep", type=int, default=None,
                        help="steps kept on the local tier (sets FLASHCKPT_LOCAL_KEEP; default 2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[flashckpt-run] %(message)s")

    enabled = not args.no_last_words
    # Restarted workers must not share the agent's rendezvous TCPStore with the failed group: keys of the
    # previous attempt (gloo's pair addresses) are still in it, so a restarted rank may connect to a dead
    # peer's port and fail or hang in init_process_group (pytorch/pytorch#135712; seen here with
    # --max_restarts and gloo in about a third of the restarts). Opting out gives every attempt a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    knobs = Knobs.from_env()
    job_id = knobs.job_id or _job_id_of(args)
    os.environ[JOB_ID_ENV] = job_id  # inherited by every (re)started worker
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the savers exit once this process is gone
    log.info("job id %s", job_id)
    if not enabled:
        os.environ[LAST_WORDS_ENV] = "0"
    if args.local_dir is not None:  # inherited by every (re)started worker, so every adapter gets the tier
        os.environ[LOCAL_DIR_ENV] = os.path.abspath(args.local_dir)
    if args.local_keep is not None:
        os.environ[LOCAL_KEEP_ENV] = str(args.local_keep)
    # The agent class launch_agent builds; only this launcher process is affected.
    agent_class = _flash_agent_class(launcher_api.LocalElasticAgent, job_id, args.term_timeout, enabled)
    launcher_api.LocalElasticAgent = agent_class  # type: ignore[misc,assignment]
    _poll_rendezvous_every(_rendezvous_poll(args))
    _rendezvous_keep_alive(args)
    import torch.distributed.elastic.multiprocessing.api as mp_api
    from flashckpt.launch.warm import WarmPool, handler_factory, make_modules_dir

    pool = None
    if not args.no_warm_workers and knobs.warm_workers:
        modules_dir = make_modules_dir()  # the workers record their imports here
        os.environ[WARM_MODULES_DIR_ENV] = modules_dir
        pool = WarmPool(knobs.warm_delay_s, modules_dir=modules_dir)
    # Every worker dies with this launcher (a SIGKILL included); with a pool, restarted ones start warm.
    mp_api.get_subprocess_handler = handler_factory(pool)
    try:
        try:
            tdr.run(args)
        finally:
            if pool is not None:
                pool.close()
                shutil.rmtree(os.environ.pop(WARM_MODULES_DIR_ENV), ignore_errors=True)
            _join_last_words(args.term_timeout)
    except SignalException as e:
        log.warning("received %s: persisting the newest snapshot before exiting", signal.Signals(e.sigval).name)
        if enabled:
            last_words_for_job(job_id, args.term_timeout)
        return 128 + int(e.sigval)
    except Exception as e:  # ChildFailedError: workers failed and restarts were exhausted
        if type(e).__name__ == "ChildFailedError":
            log.error("%s", e)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
