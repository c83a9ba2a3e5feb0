"""The engine's side of its node's saver, beyond the link's round trips: ``SaverSession``.

After a snapshot the engine asks the saver to persist it (DISK) or collects the saver's news (MEMORY,
never waiting); every status reply is absorbed here: the link's bookkeeping, the persist time for the
save policy, the commits for the deletion strategy, and the persist errors raised once (``PersistError``).
When the job's runtime dir was removed under the engine, the session drops what was bound to it and
attaches to a new saver (``renew``).

Imports ``commit.layout``, ``config``, ``memory`` and ``transport`` only; the engine hands in how to send
a request (its ``_client_call``) and what to do with a reply's persist time and commits. Used by one engine
call at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.protocol import commit_spec
from flashckpt.config import StorageType, dir_identity
from flashckpt.engine.durability import DurabilityPolicy
from flashckpt.engine.events import EventStream, Failed, Retried
from flashckpt.engine.ranks import RankInfo
from flashckpt.memory.reader import SnapshotReader
from flashckpt.memory.writer import SharedMemoryHandler
from flashckpt.storage.base import take_retries
from flashckpt.transport import messages as M
from flashckpt.transport.link import SaverLink

__all__ = ["SaverSession", "commit_spec_for"]


def commit_spec_for(ranks: RankInfo, replicated: bool) -> dict[str, Any] | None:
    """What global rank 0's saver needs to commit a step; None on other ranks."""
    return commit_spec(ranks.world_size, replicated) if ranks.rank == 0 else None


class SaverSession:
    """One engine's conversation with its node's saver.

    Args:
        link: the engine's ``SaverLink`` (attached).
        ranks / replicated / persists: this rank, the engine's replicated mode, whether this rank persists.
        handler / reader: the engine's snapshot writer and its reader of snapshots (the handler, or local
            rank 0's segments in replicated mode).
        job_dir: the job's runtime dir.
        call: sends a request to the saver (the engine's ``_client_call``; keywords ``on_reattach``).
        on_status: called with each status reply first (the persist time, the commits).
        durability: the engine's failure policy and lag bound (it sees every save and status reply).
        tier: with a local tier, makes what each persist tells the saver (``Persist.local``), else None.
        events: the engine's event stream: the saver's events in each reply, and the failures, go there.
    """

    def __init__(self, link: SaverLink, *, ranks: RankInfo, replicated: bool, persists: bool,
                 handler: SharedMemoryHandler, reader: SnapshotReader, job_dir: str, call: Callable[..., Any],
                 on_status: Callable[[M.StatusReply], None], durability: DurabilityPolicy,
                 tier: Callable[[], dict[str, Any]] | None = None, events: EventStream | None = None) -> None:
        self.link, self.ranks, self.replicated, self.persists = link, ranks, replicated, persists
        self.events = events
        self.durability = durability
        self.tier = tier  # with a local tier: makes a Persist request's ``local`` (at each persist)
        self.handler, self.reader, self.job_dir = handler, reader, job_dir
        self._call, self._on_status = call, on_status
        self._memory_in = (link.runtime, link.attaches)  # the runtime dir of the shared memory used

    def after_snapshot(self, step: int, storage_type: StorageType, target: str, ref: Any) -> None:
        """Schedules the persist of a DISK snapshot (``ref``, to ``target``) and collects the saver's news;
        then holds the lag bound (``DurabilityPolicy.check_lag``)."""
        to_storage = storage_type == StorageType.DISK and self.persists
        self.durability.saved(step, to_storage)
        if to_storage:
            self.absorb(self._persist(step, target, ref))
        else:
            st = self.link.news(ref.path if ref is not None else None, self.ranks.local_rank)
            if st is not None:  # the saver's news after a memory snapshot, never waiting for it (``SaverLink.news``)
                self.absorb(st)
        self.durability.check_lag()

    def _persist(self, step: int, target: str, ref: Any) -> M.StatusReply:
        link, handler = self.link, self.handler
        handler.mark_pending(ref)
        try:
            # A new saver (after ours died) cleared every slot's flags when it adopted the segments.
            reply: M.StatusReply = self._call(
                M.Persist(step=step, rank=self.ranks.rank, local_rank=self.ranks.local_rank, seg_path=ref.path,
                          slot=ref.slot, generation=ref.generation, path=target,
                          commit=commit_spec_for(self.ranks, self.replicated), cursor=link.cursor,
                          since=link.event_seq,
                          local=None if self.tier is None else self.tier()),
                on_reattach=lambda: handler.mark_pending(ref))
        except BaseException as e:
            handler.clear_pending(ref)
            if isinstance(e, E.CheckpointTimeoutError):  # unanswered: the saver may still persist it
                link.requested.add(step)
            raise
        link.requested.add(step)
        link.status_at = time.monotonic()
        return reply

    def absorb(self, st: M.StatusReply) -> None:
        """Takes in a status reply of the saver; raises the persist errors it reports (once).

        Raises:
            PersistError: a persist or commit failed, or persists were lost with a saver that died (with
                ``on_persist_error="warn"``: logged instead, see ``DurabilityPolicy.failed``).
        """
        if self.events is not None:
            self.events.from_saver(st.events, self.link.event_seq)
            retried = take_retries()  # this process's own requests to the store (the engine's reads)
            if retried:
                self.events.emit(Retried(time.time(), counts=retried))
        self.link.absorb(st)
        self._on_status(st)
        self.durability.observe(st.committed, st.commits)
        # A step's upload that keeps failing while the saver retries it is reported once, not per attempt.
        failed = [e["error"] for e in st.errors if not e.get("committed") and self.durability.first_report(e)]
        notes = [e["error"] for e in st.errors if e.get("committed")]  # committed steps whose tracker update failed
        msgs = [f"{len(failed)} persist(s) failed: " + "; ".join(failed)] if failed else []
        lost = self.link.take_lost()
        if lost:
            msgs.append(lost)
        if (msgs or notes) and self.events is not None:
            d = self.durability.report()
            self.events.emit(Failed(time.time(), rank=self.ranks.rank, error=". ".join(msgs + notes),
                                    durable_step=d.durable_step, local_step=d.local_step, memory_step=d.memory_step))
        if (msgs or notes) and not self.durability.failed(". ".join(msgs + notes), len(failed) + bool(lost) + len(notes)):
            return  # on_persist_error="warn": logged, training goes on
        if msgs:
            error = E.PersistError(f"{'. '.join(msgs + notes)}. Earlier committed checkpoints are intact; memory "
                                   "snapshots continue.")
            if not lost and not notes:
                error.failed_steps = tuple(sorted({int(e["step"]) for e in st.errors if not e.get("committed")}))
            raise error
        if notes:
            raise E.PersistError("; ".join(notes))

    def runtime_lost(self) -> bool:
        """Whether the job's runtime dir is no longer the one the engine's shared memory lives in (removed or
        replaced, ``dir_identity``; or the segment it writes was removed). Costs a ``stat`` or two."""
        return dir_identity(self.job_dir) != self._memory_in[0] or self.handler.segment_gone()

    def renew(self, op: str) -> None:
        """After ``runtime_lost``: drops everything bound to the lost dir (mappings, the writer lease) and
        attaches to a new saver, which starts with new shared memory (``SaverLink.reattach``, which logs one
        warning); unless the link already attached to a saver of the new dir (its connection broke meanwhile)."""
        attaches = self._memory_in[1]
        self.handler.forget_segments()
        if self.reader is not self.handler:
            self.reader.forget_segments()
        link = self.link
        if link.attaches == attaches or link.runtime != dir_identity(self.job_dir):
            link.reattach(op, None, runtime_lost=True)
        self._memory_in = (link.runtime, link.attaches)
