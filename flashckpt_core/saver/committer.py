"""The committer: the commit thread (markers, manifest, tracker, in order) and deletions (retention,
``delete_checkpoint``), ordered after the commits queued before them.

Imports the layers below the saver and ``saver.state``, ``saver.recovery``. Its thread is the only writer of
the commit records once they are ready (``saver.housekeeping`` readies them first); the request handlers
that schedule deletions run on request threads and queue them on ``SaverState.commit_q``."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import Manifest, TrackerUpdateError
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.removal import delete_step, discard_uncommitted
from flashckpt.commit.tiers import DURABLE_ROOT
from flashckpt.saver.recovery import Recovery
from flashckpt.saver.state import CommitJob, DeleteJob, DeletePathJob, LocalCommitJob, SaverState, log
from flashckpt.saver.uploader import Uploader
from flashckpt.storage import locations

__all__ = ["Committer"]


class Committer:
    """The commit thread of one saver and what it runs (see the module docstring)."""

    def __init__(self, state: SaverState, recovery: Recovery, uploader: Uploader) -> None:
        self.state = state
        self.recovery = recovery
        self.uploader = uploader
        self.layout = state.layout
        self.storage = state.storage
        # Called on the commit thread with each durable commit's manifest before the step is reported done
        # (the control server gives back an earlier layout's memory there: ``ControlServer.after_commit``).
        self.after_commit: Callable[[Manifest], None] | None = None

    def loop(self) -> None:
        """The commit thread: the work of ``SaverState.commit_q``, in order, until a None."""
        st = self.state
        while True:
            item = st.commit_q.get()
            if item is None:
                return
            if isinstance(item, CommitJob):
                self._commit(item.step, item.spec)
                continue
            if isinstance(item, LocalCommitJob):
                self._commit_local(item)
                continue
            # A deletion: ordered after the commits queued before it.
            deleted: list[int] = []
            error: BaseException | None = None
            try:
                if isinstance(item, DeleteJob):
                    deleted = self._delete_steps(list(item.steps), newest=item.newest)
                else:
                    self._delete_path(item.path)
            except Exception as e:
                error = e
                log.exception("deleting %s failed", item)
            with st.cv:
                st.work_done()
            if isinstance(item, DeleteJob) and item.done is not None:
                if error is None:
                    item.done.set_result(deleted)
                else:
                    item.done.set_exception(error)

    # ------------------------------------------------------------------ commits
    def _commit(self, step: int, spec: dict[str, Any]) -> None:
        st = self.state
        with st.cv:
            tiered = step in st.uploading  # uploaded from the local tier
        try:
            manifest = commit_step(self.layout, step, [int(r) for r in spec["ranks"]], int(spec["world_size"]),
                                   replicated=bool(spec.get("replicated", False)),
                                   extra=dict(spec.get("extra", {})),
                                   timeout=st.knobs.commit_timeout_s,
                                   stopping=lambda: st.stop.is_set() and not st.signalled,
                                   waiting=self._commit_waiting(step))
            self._committed_now(step)
            rec = st.note_commit(step, "durable", self._snapshot_at(manifest))
            st.note("commit", step=step, tier="durable", ranks=spec["ranks"], lag_s=rec["lag_s"],
                    bytes=manifest.nbytes())
            self._uploaded(step)
            if self.after_commit is not None:
                self.after_commit(manifest)
            st.finish(step, None, committed=True)
        except TrackerUpdateError as e:  # committed: never reported as a failed step
            log.error("event=commit step=%d tier=durable ranks=%s: %s", step, spec["ranks"], e)
            self._committed_now(step)
            self._uploaded(step)
            with st.cv:
                st.errors.append({"step": step, "error": str(e), "committed": True})
            st.finish(step, None, committed=True)
        except Exception as e:
            log.exception("commit of step %d failed", step)
            error = f"committing step {step} failed: {e}"
            if tiered and not isinstance(e, (E.PersistError, E.CheckpointCorruptError)) and self.uploader.retry(
                    step, f"{error} (on the durable tier {self.layout.root}; committed on the local tier)"):
                return
            self._uploaded(step)
            self._discard_failed(step, [int(r) for r in spec["ranks"]])
            st.finish(step, error, committed=False)

    @staticmethod
    def _snapshot_at(m: Manifest) -> float:
        """The wall time of the oldest snapshot the files of manifest ``m`` came from; 0 when unknown."""
        try:
            return min((t for t in m.saved_at_ranks().values() if t > 0), default=0.0)
        except (TypeError, ValueError, AttributeError):
            return 0.0

    def _uploaded(self, step: int) -> None:
        """``step`` is no longer on its way to the durable tier (local retention may remove it)."""
        with self.state.cv:
            self.state.uploading.discard(step)

    def _commit_local(self, job: LocalCommitJob) -> None:
        """Commits ``job.step`` on the local tier (this node's ranks), then queues its upload."""
        st = self.state
        local = st.local
        assert local is not None
        with st.cv:
            st.durable_keep = int(job.tier.get("durable_keep", 0))
        t0 = time.monotonic()
        manifest: Manifest | None = None
        try:
            manifest = commit_step(local, job.step, list(job.ranks), int(job.tier.get("world_size", 1)),
                                   replicated=bool(job.tier.get("replicated", False)),
                                   extra={"tier_ranks": list(job.ranks), "durable_spec": job.spec,
                                          DURABLE_ROOT: self.layout.root},
                                   timeout=st.knobs.commit_timeout_s,
                                   stopping=lambda: st.stop.is_set() and not st.signalled)
        except TrackerUpdateError as e:  # committed
            log.error("event=commit step=%d tier=local ranks=%s: %s", job.step, list(job.ranks), e)
        except Exception as e:
            log.exception("local commit of step %d failed", job.step)
            try:
                if not local.storage.exists(local.manifest_path(job.step)):
                    discard_uncommitted(local, job.step)
            except (OSError, E.FlashCheckpointError) as e2:
                log.warning("could not remove the remains of the failed local commit of step %d: %s", job.step, e2)
            st.finish(job.step, f"committing step {job.step} on the local tier {local.root} failed: {e}",
                      committed=False)
            return
        if manifest is None:  # committed, but what follows the manifest failed: read it back
            try:
                manifest = local.read_manifest(job.step)
            except (OSError, E.FlashCheckpointError):
                pass
        rec = st.note_commit(job.step, "local", 0.0 if manifest is None else self._snapshot_at(manifest))
        st.note("commit", step=job.step, tier="local", ranks=list(job.ranks), seconds=time.monotonic() - t0,
                lag_s=rec["lag_s"], path=local.root, bytes=0 if manifest is None else manifest.nbytes())
        self.uploader.enqueue(job.step)  # the unit of work goes on with it
        self._local_retention()

    def _local_retention(self) -> None:
        """Keeps the ``local_keep`` most recently committed steps of the local tier (0: all), and every step
        whose upload has not finished; never the local tier's newest step."""
        st = self.state
        local, keep = st.local, st.local_keep
        if local is None or keep <= 0:
            return
        try:
            steps = local.committed_steps()
            with st.cv:
                busy = set(st.uploading)
            old = [s for s in steps[:-keep] if s not in busy]
            for s in old:
                delete_step(local, s)
        except (OSError, E.FlashCheckpointError) as e:
            log.error("local retention in %s failed: %s", local.root, e)
            return
        if old:
            log.info("event=retention tier=local deleted=%s", old)

    def _discard_failed(self, step: int, ranks: list[int]) -> None:
        """After a failed commit of ``step`` whose ranks all finished writing (nothing writes it any more:
        its files were found gone, say), removes what they wrote at once rather than at the next start."""
        try:
            if self.layout.markers_complete(step, ranks) and not self.storage.exists(self.layout.manifest_path(step)):
                discard_uncommitted(self.layout, step)
        except (OSError, E.FlashCheckpointError) as e:  # the next start's clean-up removes it then
            log.warning("could not remove the remains of the failed commit of step %d: %s", step, e)

    def _commit_waiting(self, step: int) -> Callable[[list[int], float], None]:
        """What a commit of ``step`` does while ranks are missing: nothing for the loss bound
        (FLASHCKPT_NODE_LOSS_S), then, every bound, has the missing ranks written by whoever holds them
        (``Recovery.recover_missing``); it gives up at once when a rank was lost with its node and nobody holds
        it, and when a newer step's commit queued behind it has all of its ranks (this one can no longer be
        the newest: a node that wrote it is gone). Nothing waits for a node that is gone."""
        bound = self.recovery.loss_bound()  # None: a single-node job (no peer service yet)
        asked = [0.0]

        def waiting(missing: list[int], waited: float) -> None:
            self._failed_here(step, missing)
            if bound is None or waited < asked[0] + bound:
                return
            asked[0] = waited
            queued = {j.step: [int(r) for r in j.spec["ranks"]] for j in list(self.state.commit_q.queue)
                      if isinstance(j, CommitJob) and j.step != step}
            for s, ranks in queued.items():
                if self.layout.markers_complete(s, ranks):
                    raise E.PersistError(f"step {step}: ranks {missing} never finished persisting and step {s}, "
                                         "saved after it, has every rank's files; not committed")
            lost = self.recovery.recover_missing(step, missing)
            if lost:
                raise E.PersistError(f"step {step}: ranks {lost} were lost with their node and no backup holds "
                                     "them; not committed (the previous committed step stays the newest)")

        return waiting

    def _failed_here(self, step: int, missing: list[int]) -> None:
        """Raises the failure of a missing rank whose persist of ``step`` failed on this node: the store that
        failed it may refuse its failed marker too, and the commit must not wait for its timeout then."""
        with self.state.cv:
            failed = [(r, self.state.failures[(step, r)]) for r in missing if (step, r) in self.state.failures]
        if failed:
            r, why = failed[0]
            raise E.PersistError(f"step {step}: rank {r} failed to persist: {why}")

    def _committed_now(self, step: int) -> None:
        """Adds ``step`` to the committed steps, less those its commit superseded."""
        st = self.state
        with st.cv:  # in commit order: the step committed last is the newest
            st.committed = [s for s in st.committed
                            if s != step and self.storage.exists(self.layout.manifest_path(s))] + [step]

    # ------------------------------------------------------------------ deletions, as clients ask them
    def schedule_delete_steps(self, steps: list[int]) -> None:
        """Queues the deletion of ``steps`` and returns at once (a trainer's retention: unlinking a GB-sized
        file takes a fraction of a second, never inside a trainer's save())."""
        with self.state.cv:
            self.state.inflight += 1
        self.state.commit_q.put(DeleteJob(tuple(steps)))

    def delete_steps_now(self, steps: list[int], *, newest: bool) -> list[int]:
        """Deletes ``steps`` on the commit thread and waits for it; returns the steps deleted."""
        st = self.state
        # A step whose manifest is on storage but whose commit is still finishing here (a reader of the
        # manifests, such as an adapter, may ask at that moment) is deleted once its commit is done.
        deadline = time.monotonic() + st.knobs.commit_timeout_s
        with st.cv:
            while any(s not in st.committed and not st.step_done(s) for s in steps):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                st.cv.wait(timeout=min(left, 0.2))
            st.inflight += 1
        # On the commit thread, like every change to the commit records: a commit running now (another
        # step's) and this deletion never write the tracker at the same time, and the tracker ends up
        # naming the newest step that is left.
        done: Future[list[int]] = Future()
        st.commit_q.put(DeleteJob(tuple(steps), newest=newest, done=done))
        try:
            return done.result(timeout=max(1.0, deadline - time.monotonic()) + st.knobs.commit_timeout_s)
        except FutureTimeout:
            raise E.CheckpointTimeoutError(f"delete_steps({list(steps)}): the commits queued before it did not "
                                           f"finish within {st.knobs.commit_timeout_s:.0f} s") from None

    def schedule_delete_path(self, path: str) -> list[int] | None:
        """Queues the deletion of ``path`` (normalized); the committed steps it holds, None when nothing is
        there. Refusals raise CheckpointDirError (``path_deletion``), before anything is deleted."""
        steps = self.path_deletion(path)
        if not (self.storage.exists(path) or self.storage.isdir(path)):
            return None
        with self.state.cv:
            self.state.inflight += 1
        self.state.commit_q.put(DeletePathJob(path))
        return steps

    def path_deletion(self, path: str) -> list[int]:
        """The committed steps whose files all lie at or under ``path``, which a deletion strategy's
        ``delete_func`` may remove (with them).

        Raises:
            CheckpointDirError: ``path`` may not be deleted: it is outside the checkpoint dir (or reaches
                out through a symlink), the checkpoint dir itself, flashckpt's commit records, or holds the
                newest committed step, only part of a committed step, or a step being persisted.
        """
        what = f"delete_func({path!r})"
        self._refuse_place(path, what)
        st = self.state
        with st.cv:
            committed = list(st.committed)
            busy = {s: set(step.paths) for s, step in st.steps.items() if not st.step_done(s)}
        self._refuse_in_flight(path, what, busy)
        return self._committed_under(path, what, committed)

    def _refuse_place(self, path: str, what: str) -> None:
        """Raises CheckpointDirError when ``path`` is the checkpoint dir itself, outside it, or holds (or is
        inside) the commit records."""
        root, meta = self.layout.root, self.layout.meta
        if path == root:
            raise E.CheckpointDirError(f"{what}: that is the checkpoint dir itself; delete one checkpoint's file or "
                                       "directory inside it")
        try:
            self.layout.rel(path)
        except E.CheckpointDirError:
            raise E.CheckpointDirError(f"{what}: {path} is outside the checkpoint dir {root} (or reaches outside it "
                                       "through a symlink); only checkpoints inside it are deleted") from None
        if locations.inside(path, meta) or locations.inside(meta, path):
            raise E.CheckpointDirError(f"{what}: {path} holds flashckpt's commit records ({meta}); they are "
                                       "removed with their steps, never directly")

    @staticmethod
    def _refuse_in_flight(path: str, what: str, busy: dict[int, set[str]]) -> None:
        """Raises CheckpointDirError when ``path`` overlaps where a step being persisted (``busy``: step ->
        its paths) writes."""
        for s, targets in busy.items():
            for t in targets:
                if locations.inside(t, path) or locations.inside(path, t):
                    raise E.CheckpointDirError(f"{what}: step {s} is being persisted to {t}; it is not deleted "
                                               "while in flight (try again after its commit)")

    def _committed_under(self, path: str, what: str, committed: list[int]) -> list[int]:
        """The ``committed`` steps whose files all lie at or under ``path`` (unreadable manifests skipped);
        raises CheckpointDirError when ``path`` holds the newest committed step or only part of a step."""
        root = self.layout.root
        covered = []

        def under(f: str) -> bool:
            return locations.inside(f, path)

        for s in committed:
            try:
                m = self.layout.read_manifest(s)
            except E.CheckpointCorruptError:
                continue
            files = [locations.join(root, f.path) for f in m.all_files()]
            inside = [f for f in files if under(f)]
            if not inside:
                continue
            if s == committed[-1]:
                raise E.CheckpointDirError(f"{what}: {path} holds step {s}, the newest committed checkpoint, which "
                                           "is never deleted")
            if len(inside) < len(files):
                rest = [f for f in files if not under(f)]
                raise E.CheckpointDirError(f"{what}: {path} holds only part of committed step {s} (its other files: "
                                           f"{', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''}); delete the "
                                           "whole checkpoint (or the step: delete_func(step))")
            covered.append(s)
        return covered

    # ------------------------------------------------------------------ deletions, on the commit thread
    def _delete_path(self, path: str) -> None:
        """Deletes ``path`` for a deletion strategy: the committed steps it holds (their records first),
        then what is left there. Checked again here: a persist or commit may have come since the request."""
        try:
            steps = self.path_deletion(path)
        except E.CheckpointDirError as e:
            log.error("not deleting %s: %s", path, e)
            return
        if steps:
            for s in steps:
                delete_step(self.layout, s)
            with self.state.cv:
                self.state.committed = [s for s in self.state.committed if s not in steps]
        if self.storage.isdir(path):
            self.storage.remove_tree(path)
        else:
            self.storage.remove(path)
        log.info("event=retention deleted_path=%s steps=%s", path, steps)

    def _delete_steps(self, steps: list[int], *, newest: bool = False) -> list[int]:
        """Deletes the committed ``steps`` (never a step that is not committed); the newest committed step
        only with ``newest`` (a framework that deletes its own checkpoints), and the tracker then names the
        newest step left. Steps being persisted are not committed, so never touched."""
        st = self.state
        with st.cv:
            committed = list(st.committed)
        if not committed:
            return []
        deleted = []
        for s in steps:
            if (s == committed[-1] and not newest) or s not in committed:
                continue
            delete_step(self.layout, s)
            deleted.append(s)
        with st.cv:
            st.committed = [s for s in st.committed if s not in deleted]
            left = list(st.committed)
        if committed[-1] in deleted:
            self.layout.write_tracker(left[-1] if left else None)
        if deleted:
            log.info("event=retention deleted=%s", deleted)
        return deleted
