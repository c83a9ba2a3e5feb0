"""Recovery after a node loss, across the job's nodes: which peer persists what of a rank whose own node is
gone (``recover_missing``, for a commit that waited the loss bound), the newest step every rank can get from
memory on some node (``newest_across_nodes``, for last words), and a survivor's commit when global rank 0
was lost with its node (``take_over_commit``). It asks the peers (``Replica``'s book and secret) for their
inventories and to persist what they hold; this node's own share is queued by ``PersistQueues.persist_held``.

Imports the layers below the saver and ``saver.state``, ``saver.persist``, ``saver.replica``. Runs on the commit
thread (``recover_missing``) and the last-words threads; the choice of a step to persist is made under
``SaverState.last_words_lock``."""

from __future__ import annotations

import threading
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.protocol import commit_spec
from flashckpt.saver.persist import PersistQueues
from flashckpt.saver.replica import Replica, ReplicaService
from flashckpt.saver.state import SaverState, log, saved_at
from flashckpt.transport.peers import across_nodes, connect, takes_over_rank0
from flashckpt.transport.wire import recv_msg, send_msg

__all__ = ["Recovery"]


class Recovery:
    """Cross-node recovery of one saver (see the module docstring)."""

    def __init__(self, state: SaverState, replica: ReplicaService, persist: PersistQueues) -> None:
        self.state = state
        self.replica = replica
        self.persist = persist

    def loss_bound(self) -> float | None:
        """How long a commit waits for a missing rank before it asks who holds it (FLASHCKPT_NODE_LOSS_S);
        None without a peer service (a single-node job)."""
        rep = self.replica.rep
        return rep.knobs.loss_s if rep is not None else None

    def _ask_peers(self, rep: Replica, msg: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """``msg``'s reply from every other peer in the book that answers within the loss bound."""
        replies: dict[int, dict[str, Any]] = {}

        def ask(node: int, entry: dict[str, Any]) -> None:
            try:
                conn = connect(str(entry["host"]), int(entry["port"]), rep.secret, timeout=rep.knobs.loss_s)
            except (OSError, E.FlashCheckpointError):
                return
            try:
                conn.settimeout(rep.knobs.loss_s * 2)
                send_msg(conn, msg)
                replies[node] = recv_msg(conn)
            except (OSError, E.FlashCheckpointError):
                pass
            finally:
                conn.close()

        entries: dict[str, tuple[int, dict[str, Any]]] = {}  # one question per saver (an entry may be stale)
        for n, e in sorted(rep.book.read().items()):
            if e.get("instance") != rep.instance:
                entries[str(e.get("instance"))] = (n, e)
        threads = [threading.Thread(target=ask, args=ne, daemon=True) for ne in entries.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(rep.knobs.loss_s * 3 + 1)
        return replies

    def recover_missing(self, step: int, missing: list[int]) -> list[int]:
        """A commit of ``step`` has waited the loss bound for ``missing`` ranks: has someone write them.

        Each missing rank is persisted by whoever holds it: its own node's saver (alive, or a fresh one that
        fetched it) or else a backup holder, this saver included. Returns the ranks that nobody writes and
        nobody holds: lost with their node and without a backup."""
        rep = self.replica.rep
        if rep is None:
            return []
        peers = list(self._ask_peers(rep, {"op": "inventory"}).values())
        invs = [*peers, {**self.replica.inventory().to_wire(), "self": True}]
        covered = {int(r) for inv in invs for s, r in inv.get("persisting", []) if s == step}
        holders: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}  # rank -> (preference, node, inventory)
        for inv in invs:
            for e in inv.get("held", []):
                if e.get("step") == step and e.get("rank") in missing:
                    pref = 0 if e.get("kind") == "own" else 1
                    holders.setdefault(int(e["rank"]), []).append((pref, int(inv.get("node", -1)), inv))
        todo: dict[str, tuple[dict[str, Any], list[int]]] = {}  # instance -> (its inventory, ranks to write)
        lost = []
        for r in missing:
            if r in covered:
                continue
            if r not in holders:
                lost.append(r)
                continue
            inv = min(holders[r], key=lambda h: h[:2])[2]
            todo.setdefault(str(inv.get("instance")), (inv, []))[1].append(r)
        for inv, ranks in todo.values():
            if inv.get("self"):
                self.persist.persist_held(step, ranks)
                continue
            try:
                conn = connect(str(inv["host"]), int(inv["port"]), rep.secret, timeout=rep.knobs.loss_s)
                try:
                    conn.settimeout(rep.knobs.loss_s * 2)
                    send_msg(conn, {"op": "persist_held", "step": step, "ranks": ranks})
                    log.warning("event=persist_held_asked step=%d ranks=%s node=%s answer=%s", step, ranks,
                                inv.get("node"), recv_msg(conn).get("ranks"))
                finally:
                    conn.close()
            except (OSError, KeyError, E.FlashCheckpointError) as e:
                log.warning("asking node %s to persist ranks %s of step %d: %s", inv.get("node"), ranks, step, e)
        return lost

    # ------------------------------------------------------------------ last words for a lost rank 0
    def newest_across_nodes(self) -> tuple[int | None, list[dict[str, Any]]]:
        """The newest step of a multi-node job that every rank can get from memory, its own node's or a
        peer's (``across_nodes`` over every answering saver's inventory), and those peers' inventories; None
        in a single-node job, and when there is none (a rank lost with its whole backup group, or peers that
        no longer answer after a normal end: then each node persists its own newest, as a single node does)."""
        rep = self.replica.rep
        if rep is None or rep.world_size < 2:
            return None, []
        with self.state.cv:
            newest_committed = self.state.committed[-1] if self.state.committed else -1
        peers = list(self._ask_peers(rep, {"op": "inventory"}).values())
        invs = [*peers, self.replica.inventory().to_wire()]
        plan = across_nodes(invs, list(range(rep.world_size)), replicated=rep.replicated,
                            saved_at=saved_at(self.state.layout, newest_committed), newest_committed=newest_committed,
                            world_size=rep.world_size)
        if plan.step is None:
            if plan.partial is not None:
                log.warning("last words: step %d is in memory, but no saver that answered holds ranks %s (lost "
                            "with their node and its backup group, or their saver has ended): this node persists "
                            "its own newest snapshot, which commits only if their files come", plan.partial,
                            list(plan.missing))
            return None, peers
        return plan.step, peers

    def _committed_by_rank0(self, step: int) -> bool:
        """Whether ``step`` is committed on the checkpoint dir already: this saver's own list of commits is as
        of its start (it commits none), and rank 0's saver may have committed the step and ended before this
        one's last words (a normal end: a re-persist of rank 0's files of a committed step would rewrite them
        and, on an object store, upload them again). A checkpoint dir that cannot be read: False (logged)."""
        try:
            committed = self.state.layout.committed_steps()
        except (OSError, E.FlashCheckpointError) as e:
            log.warning("last words: could not list the commits of %s (%s); taking over rank 0's commit of step %d",
                        self.state.layout.root, e, step)
            return False
        if step in committed:
            log.info("last words: step %d is committed on %s already (by global rank 0's saver); nothing to take "
                     "over", step, self.state.layout.root)
        return step in committed

    def take_over_commit(self, timeout: float | None, limit: int | None, peers: list[dict[str, Any]]) -> int | None:
        """Last words on a node whose saver does not commit (global rank 0 was elsewhere): when rank 0's own
        saver is gone (its node lost), the survivor that holds rank 0's newest snapshot (sharded state: a
        backup of it; replicated state: its own copy), the lowest-numbered if several do, persists it with the
        commit, so the newest step is committed as well. The commit then has the lost node's other ranks
        written by whoever holds them (``_recover_missing``). Waits for the commit; returns its step, or None
        when there is nothing to take over (``takes_over_rank0``, over ``peers``: the inventories that chose
        ``limit``; a rank 0 saver alive shows its own snapshot there, whenever its last words start)."""
        rep = self.replica.rep
        with self.state.cv:
            newest_committed = self.state.committed[-1] if self.state.committed else -1
        if rep is None or limit is None:
            return None
        step = limit  # the newest step every rank can get: the one the survivors persist
        if step == newest_committed:
            return None
        own = self.replica.inventory().to_wire()
        if not takes_over_rank0(step, own, peers, node=rep.node, replicated=rep.replicated):
            return None
        if self._committed_by_rank0(step):
            return None
        with self.state.last_words_lock:  # once, when last words are asked twice (a crash seen here and by the agent)
            with self.state.cv:
                st = self.state.steps.get(step)
                queued = st is not None and 0 in st.ranks and st.commits_here and st.status != "failed"
            if not queued:
                kind = self.persist.persist_held_copy(0, step, -1 if rep.replicated else 0,
                                               commit_spec(rep.world_size, rep.replicated))
                if kind is None:
                    return None
                log.warning("event=last_words_for_rank0 step=%d from=%s: global rank 0's saver is gone; this "
                            "survivor commits the step", step, kind)
        self.state.wait_step(step, timeout)
        return step
