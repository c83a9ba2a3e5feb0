"""Committing: the commit thread (markers, manifest, tracker, in order), status and waits for clients,
and deletions (retention, ``delete_checkpoint``), ordered after the commits queued before them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import TrackerUpdateError
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.removal import delete_step, discard_uncommitted
from flashckpt.saver._base import SaverBase, _CommitJob, _DeleteJob, _StepState, log
from flashckpt.storage import locations


class CommitPart(SaverBase):
    def _commit_loop(self) -> None:
        while True:
            item = self._commit_q.get()
            if item is None:
                return
            if isinstance(item, _CommitJob):
                self._commit(item.step, item.spec)
                continue
            # A deletion: ordered after the commits queued before it.
            deleted: list[int] = []
            error: BaseException | None = None
            try:
                if isinstance(item, _DeleteJob):
                    deleted = self._delete_steps(list(item.steps), newest=item.newest)
                else:
                    self._delete_path(item.path)
            except Exception as e:
                error = e
                log.exception("deleting %s failed", item)
            with self._cv:
                self._work_done()
            if isinstance(item, _DeleteJob) and item.done is not None:
                if error is None:
                    item.done.set_result(deleted)
                else:
                    item.done.set_exception(error)

    def _commit(self, step: int, spec: dict[str, Any]) -> None:
        try:
            commit_step(self.layout, step, [int(r) for r in spec["ranks"]], int(spec["world_size"]),
                        replicated=bool(spec.get("replicated", False)),
                        extra=dict(spec.get("extra", {})),
                        timeout=self.knobs.commit_timeout_s,
                        stopping=lambda: self._stop.is_set() and not self._signalled,
                        waiting=self._commit_waiting(step))
            self._committed_now(step)
            log.info("event=commit step=%d ranks=%s", step, spec["ranks"])
            self._finish(step, None, committed=True)
        except TrackerUpdateError as e:  # committed: never reported as a failed step
            log.error("event=commit step=%d ranks=%s: %s", step, spec["ranks"], e)
            self._committed_now(step)
            with self._cv:
                self._errors.append({"step": step, "error": str(e), "committed": True})
            self._finish(step, None, committed=True)
        except Exception as e:
            log.exception("commit of step %d failed", step)
            self._discard_failed(step, [int(r) for r in spec["ranks"]])
            self._finish(step, f"committing step {step} failed: {e}", committed=False)

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
        (``_recover_missing``); it gives up at once when a rank was lost with its node and nobody holds it,
        and when a newer step's commit queued behind it has all of its ranks (this one can no longer be the
        newest: a node that wrote it is gone). Nothing waits for a node that is gone."""
        rep = self._rep
        bound = rep.knobs.loss_s if rep is not None else 0.0
        asked = [0.0]

        def waiting(missing: list[int], waited: float) -> None:
            if rep is None or waited < asked[0] + bound:
                return
            asked[0] = waited
            queued = {j.step: [int(r) for r in j.spec["ranks"]] for j in list(self._commit_q.queue)
                      if isinstance(j, _CommitJob) and j.step != step}
            for s, ranks in queued.items():
                if self.layout.markers_complete(s, ranks):
                    raise E.PersistError(f"step {step}: ranks {missing} never finished persisting and step {s}, "
                                         "saved after it, has every rank's files; not committed")
            lost = self._recover_missing(step, missing)
            if lost:
                raise E.PersistError(f"step {step}: ranks {lost} were lost with their node and no backup holds "
                                     "them; not committed (the previous committed step stays the newest)")

        return waiting

    def _committed_now(self, step: int) -> None:
        """Adds ``step`` to the committed steps, less those its commit superseded."""
        with self._cv:  # in commit order: the step committed last is the newest
            self._committed = [s for s in self._committed
                               if s != step and self.storage.exists(self.layout.manifest_path(s))] + [step]

    def _finish(self, step: int, error: str | None, *, committed: bool) -> None:
        with self._cv:
            st = self._steps.setdefault(step, _StepState())
            if error is not None:
                st.status, st.error = "failed", error
                self._errors.append({"step": step, "error": error})
            elif committed:
                st.status = "committed"
            elif st.status == "persisting":
                st.status = "persisted"
            self._work_done()

    def _status(self, cursor: int) -> dict[str, Any]:
        with self._cv:
            return {"committed": list(self._committed), "errors": self._errors[cursor:],
                    "cursor": len(self._errors), "inflight": self._inflight,
                    "last_persist_s": self.stats.last_persist_s, "records_ready": self._records_ready}

    def _wait(self, timeout: float, cursor: int) -> dict[str, Any]:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        with self._cv:
            while self._inflight > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise E.CheckpointTimeoutError(
                        f"wait(): {self._inflight} persist(s) still running after {timeout:.0f} s")
                self._cv.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return self._status(cursor)

    def _path_deletion(self, path: str) -> list[int]:
        """The committed steps whose files all lie at or under ``path``, which a deletion strategy's
        ``delete_func`` may remove (with them).

        Raises:
            CheckpointDirError: ``path`` may not be deleted: it is outside the checkpoint dir (or reaches
                out through a symlink), the checkpoint dir itself, flashckpt's commit records, or holds the
                newest committed step, only part of a committed step, or a step being persisted.
        """
        root, meta = self.layout.root, self.layout.meta
        what = f"delete_func({path!r})"
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
        with self._cv:
            committed = list(self._committed)
            busy = {s: set(st.paths) for s, st in self._steps.items() if not self._step_done(s)}
        for s, targets in busy.items():
            for t in targets:
                if locations.inside(t, path) or locations.inside(path, t):
                    raise E.CheckpointDirError(f"{what}: step {s} is being persisted to {t}; it is not deleted "
                                               "while in flight (try again after its commit)")
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

    def _delete_path(self, path: str) -> None:
        """Deletes ``path`` for a deletion strategy: the committed steps it holds (their records first),
        then what is left there. Checked again here: a persist or commit may have come since the request."""
        try:
            steps = self._path_deletion(path)
        except E.CheckpointDirError as e:
            log.error("not deleting %s: %s", path, e)
            return
        if steps:
            for s in steps:
                delete_step(self.layout, s)
            with self._cv:
                self._committed = [s for s in self._committed if s not in steps]
        if self.storage.isdir(path):
            self.storage.remove_tree(path)
        else:
            self.storage.remove(path)
        log.info("event=retention deleted_path=%s steps=%s", path, steps)

    def _delete_steps(self, steps: list[int], *, newest: bool = False) -> list[int]:
        """Deletes the committed ``steps`` (never a step that is not committed); the newest committed step
        only with ``newest`` (a framework that deletes its own checkpoints), and the tracker then names the
        newest step left. Steps being persisted are not committed, so never touched."""
        with self._cv:
            committed = list(self._committed)
        if not committed:
            return []
        deleted = []
        for s in steps:
            if (s == committed[-1] and not newest) or s not in committed:
                continue
            delete_step(self.layout, s)
            deleted.append(s)
        with self._cv:
            self._committed = [s for s in self._committed if s not in deleted]
            left = list(self._committed)
        if committed[-1] in deleted:
            self.layout.write_tracker(left[-1] if left else None)
        if deleted:
            log.info("event=retention deleted=%s", deleted)
        return deleted

