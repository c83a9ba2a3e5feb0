"""The cross-node replica's pure parts: backup groups and the agreement on what memory holds across nodes.
(The replica at work, with nodes in their own mount namespaces, is tests/multiproc/test_multinode.py.)"""

from __future__ import annotations

import pytest
from flashckpt import errors as E
from flashckpt.engine.agreement import across_nodes
from flashckpt.storage.registry import storage_for
from flashckpt.transport.peers import PeerBook, ReplicaKnobs, backup_group, partners, takes_over_rank0


def test_pairs_span_the_two_halves_of_the_job_by_default():
    assert backup_group(0, 2) == [0, 1]
    assert [backup_group(n, 4) for n in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert backup_group(3, 8) == [3, 7]
    assert partners(7, 8) == [3]


def test_group_size_and_stride_are_configurable_and_every_node_has_a_partner():
    assert [backup_group(n, 4, stride=1) for n in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert backup_group(4, 6, size=3, stride=2) == [0, 2, 4]
    for nnodes in range(2, 12):
        for size in (2, 3):
            for stride in (0, 1, 2):
                for n in range(nnodes):
                    assert partners(n, nnodes, size, stride), (n, nnodes, size, stride)
    assert backup_group(2, 3) == [1, 2]  # left alone by the block: backs up to its neighbour
    with pytest.raises(E.InvalidArgumentError):
        backup_group(4, 4)


def test_knobs(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_REPLICA", "off")
    assert not ReplicaKnobs.from_env().active(4)
    monkeypatch.setenv("FLASHCKPT_REPLICA", "sometimes")
    with pytest.raises(E.InvalidArgumentError, match="FLASHCKPT_REPLICA"):
        ReplicaKnobs.from_env()
    monkeypatch.delenv("FLASHCKPT_REPLICA")
    assert ReplicaKnobs.from_env().active(2) and not ReplicaKnobs.from_env().active(1)


def _snap(rank, step, kind="own", lr=0, t=None, fetched=False):
    return {"rank": rank, "step": step, "wall_time": float(step if t is None else t), "seq": step, "kind": kind,
            "local_rank": lr, "fetched": fetched}


def _node(node, held, persisting=()):
    return {"node": node, "instance": f"i{node}", "host": "127.0.0.1", "port": 1000 + node, "held": held,
            "persisting": [list(p) for p in persisting]}


def test_a_lost_nodes_ranks_come_from_the_backups_of_its_partner():
    survivor = _node(0, [_snap(0, 30), _snap(0, 29), _snap(1, 30, lr=1), _snap(1, 29, lr=1),
                         _snap(2, 30, "backup"), _snap(3, 30, "backup"), _snap(2, 28, "backup")])
    fresh = _node(1, [])
    rows = [survivor, survivor, fresh, fresh]  # one inventory per rank: two ranks per node
    plan = across_nodes(rows, range(4), replicated=False, saved_at={}, newest_committed=20)
    assert plan.step == 30
    assert [h["kind"] for h in plan.sources[2]] == ["backup"] and plan.sources[2][0]["port"] == 1000
    assert plan.sources[0][0]["kind"] == "own"


def test_a_whole_group_lost_leaves_memory_to_storage_and_names_the_ranks():
    survivor = _node(0, [_snap(0, 30), _snap(1, 30)])
    plan = across_nodes([survivor, _node(1, [])], range(4), replicated=False, saved_at={}, newest_committed=20)
    assert plan.step is None and plan.partial == 30 and plan.missing == (2, 3)


def test_memory_older_than_the_newest_commit_is_not_used():
    node = _node(0, [_snap(0, 30, t=100.0), _snap(1, 30, t=100.0)])
    assert across_nodes([node], [0, 1], replicated=False, saved_at={"0": 200.0, "1": 200.0},
                        newest_committed=30).step is None
    assert across_nodes([node], [0, 1], replicated=False, saved_at={}, newest_committed=31).step is None
    assert across_nodes([node], [0, 1], replicated=False, saved_at={"0": 100.0, "1": 100.0},
                        newest_committed=30).step == 30


def test_replicated_state_needs_one_copy_anywhere():
    plan = across_nodes([_node(0, [_snap(0, 12)]), _node(1, [])], [0, 1], replicated=True, saved_at={},
                        newest_committed=10)
    assert plan.step == 12 and plan.sources[1][0]["node"] == 0


def test_slots_of_older_versions_name_no_rank_and_are_left_out():
    assert across_nodes([_node(0, [_snap(-1, 30)])], [0], replicated=False, saved_at={},
                        newest_committed=-1).step is None


def test_a_survivor_holding_rank0s_backup_commits_for_it_only_when_rank0s_saver_is_gone():
    survivor = _node(1, [_snap(1, 30), _snap(0, 30, "backup"), _snap(0, 29, "backup")])
    assert takes_over_rank0(30, survivor, [], node=1, replicated=False)  # rank 0's node did not answer
    fresh = _node(0, [_snap(0, 30, fetched=True)])  # a fresh node 0 that fetched rank 0's shard already
    assert takes_over_rank0(30, survivor, [fresh], node=1, replicated=False)
    alive = _node(0, [_snap(0, 30)])  # rank 0's own saver answers: its last words commit
    assert not takes_over_rank0(30, survivor, [alive], node=1, replicated=False)
    assert not takes_over_rank0(30, survivor, [_node(0, [], persisting=[(30, 0)])], node=1, replicated=False)
    assert not takes_over_rank0(31, survivor, [], node=1, replicated=False)  # holds no copy of step 31
    assert not takes_over_rank0(30, _node(1, [_snap(1, 30)]), [], node=1, replicated=False)


def test_with_three_copies_the_lowest_numbered_survivor_takes_over():
    backups = [_snap(0, 30, "backup")]
    assert not takes_over_rank0(30, _node(2, backups), [_node(1, backups)], node=2, replicated=False)
    assert takes_over_rank0(30, _node(1, backups), [_node(2, backups)], node=1, replicated=False)


def test_replicated_survivors_persist_their_own_copy_not_a_fetched_one():
    assert takes_over_rank0(12, _node(1, [_snap(1, 12)]), [], node=1, replicated=True)
    assert not takes_over_rank0(12, _node(1, [_snap(1, 12, fetched=True)]), [], node=1, replicated=True)
    assert not takes_over_rank0(12, _node(2, [_snap(2, 12)]), [_node(1, [_snap(1, 12)])], node=2, replicated=True)


def test_a_saver_that_moved_withdraws_its_old_entry_but_not_a_successors(tmp_path):
    storage = storage_for(str(tmp_path))
    book = PeerBook(storage, str(tmp_path / "meta"), "job")
    book.publish(1, {"host": "127.0.0.1", "port": 5, "instance": "a"})
    book.publish(3, {"host": "127.0.0.1", "port": 6, "instance": "b"})
    book.withdraw(1, "a")
    book.withdraw(3, "a")  # node 3 is another saver's now
    assert {n: e["instance"] for n, e in book.read().items()} == {3: "b"}


def test_ls_shows_what_this_nodes_memory_and_backups_hold(tmp_path, capsys):
    import json
    import os
    import shutil

    from flashckpt.cli import main
    from flashckpt.config import Knobs, job_key_digest
    from flashckpt.format.segment import COMPLETE, Segment, SlotHeader
    from flashckpt.saver.segments import BACKUP_BASE

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    jd = os.path.join(Knobs.from_env().runtime_dir, "job-" + job_key_digest(ckpt))
    os.makedirs(jd, mode=0o700)
    try:
        for name, lr, owner in (("seg-r000-e000000.shm", 0, 1), ("bak-r00003-e000000.shm", BACKUP_BASE + 3, 4)):
            path = os.path.join(jd, name)
            Segment.create(path, local_rank=lr, epoch=0, nslots=2, meta_cap=4096, data_cap=4096)
            seg = Segment(path, populate=False)
            seg.write_header(0, SlotHeader(COMPLETE, 0, 7, 1, 0, 0, 0, 0, 1.0, 1, owner))
            seg.close()
        assert main(["ls", "--json", ckpt]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert rows == [{"step": 7, "state": "in memory", "latest": False, "bytes": None, "saved_at": None,
                         "files": [], "note": "(this node's shared memory)",
                         "memory": {"ranks": [0], "backups_of_ranks": [3]}, "tiers": "memory",
                         "training_step": None, "epoch": None, "age_s": None}]
    finally:
        shutil.rmtree(jd)


def test_flashckpt_run_detects_a_lost_node_in_seconds_and_keeps_what_the_user_set(monkeypatch):
    from argparse import Namespace

    from flashckpt.launch.launcher import _rendezvous_keep_alive

    monkeypatch.delenv("FLASHCKPT_RDZV_KEEP_ALIVE_S", raising=False)
    monkeypatch.delenv("FLASHCKPT_RDZV_POLL_S", raising=False)
    args = Namespace(rdzv_backend="c10d", rdzv_conf="", nnodes="2", standalone=False)
    _rendezvous_keep_alive(args)
    assert args.rdzv_conf == "keep_alive_interval=1,keep_alive_max_attempt=3"
    args = Namespace(rdzv_backend="c10d", rdzv_conf="timeout=60,keep_alive_interval=10", nnodes="2", standalone=False)
    _rendezvous_keep_alive(args)
    assert args.rdzv_conf == "timeout=60,keep_alive_interval=10,keep_alive_max_attempt=3"
    args = Namespace(rdzv_backend="c10d", rdzv_conf="", nnodes="1:128", standalone=False)  # large jobs: torch's
    _rendezvous_keep_alive(args)
    assert args.rdzv_conf == ""


def test_a_slot_larger_than_the_socket_buffer_goes_through_a_socket_with_a_timeout(tmp_path):
    """Peer sockets have timeouts, so Python makes them non-blocking underneath: sendfile then stops with
    EAGAIN once the send buffer is full (every backup of a 500 MB shard failed so before)."""
    import os
    import socket
    import threading

    from flashckpt.transport.peers import Pacer, recv_into, send_range

    data = os.urandom(48 << 20)
    path = tmp_path / "slot"
    path.write_bytes(data)
    a, b = socket.socketpair()
    a.settimeout(30)
    b.settimeout(30)
    out = bytearray(len(data))
    t = threading.Thread(target=recv_into, args=(b, memoryview(out)))
    t.start()
    fd = os.open(path, os.O_RDONLY)
    try:
        send_range(a, fd, 0, len(data), Pacer(0))
    finally:
        os.close(fd)
        t.join(30)
        a.close()
        b.close()
    assert out == data


def _backup(saver, rank: int, step: int, *, flags: int = 0, nbytes: int = 1 << 20) -> str:
    """A backup segment of ``rank`` in ``saver``'s job dir holding a complete backup of ``step``."""
    import os

    from flashckpt.format.segment import COMPLETE, Segment, SlotHeader
    from flashckpt.saver.segments import BACKUP_BASE

    path = os.path.join(saver.job_dir, f"bak-r{rank:05d}-e000000.shm")
    Segment.create(path, local_rank=BACKUP_BASE + rank, epoch=0, nslots=2, meta_cap=4096, data_cap=nbytes)
    seg = saver.pool.segment(path)
    seg.write_header(0, SlotHeader(COMPLETE, flags, step, 1, 0, 0, 0, 0, float(step), step, rank + 1))
    return path


def test_backups_give_way_to_own_snapshots_and_newer_backups_never_busy_ones(tmp_path):
    """The real saver's space rules, in this process (FLASHCKPT_SHM_LIMIT_BYTES plays a small /dev/shm):
    a newer backup makes room from older backups of other ranks (ranks that moved at a restart), never
    from newer ones; an allocation for this node's own snapshots drops backups, oldest first, rather than
    failing; a backup being persisted or sent is never dropped."""
    import dataclasses
    import os

    from flashckpt.config import Knobs
    from flashckpt.format.segment import FLAG_SENDING
    from flashckpt.saver.server import CheckpointSaver

    job = tmp_path / "job"
    job.mkdir()
    knobs = dataclasses.replace(Knobs.from_env(), shm_limit_bytes=8 << 20)
    saver = CheckpointSaver(str(job), str(tmp_path / "ckpt"), knobs=knobs)
    old1 = _backup(saver, 1, 12)
    new2 = _backup(saver, 2, 20)
    busy3 = _backup(saver, 3, 11, flags=FLAG_SENDING)
    free = saver.pool.shm_free()
    saver.pool.drop_backups(free + (1 << 20), keep=4, older_than=20)  # a backup of rank 4, step 20, needs room
    assert not os.path.exists(old1) and os.path.exists(new2) and os.path.exists(busy3)
    # own snapshots come first: an allocation that does not fit drops the remaining backups it can
    path = saver.pool.alloc(0, 4096, 5 << 20, 1)
    assert os.path.exists(path) and not os.path.exists(new2) and os.path.exists(busy3)


def test_an_earlier_layouts_memory_is_given_back_only_once_storage_holds_a_newer_state_of_the_new_one(tmp_path):
    """After a resharded resume (4 ranks -> 3): backups, fetched copies and a gone local rank's segments whose
    snapshots all belong to the 4-rank job and are older than the newest commit's snapshots are removed; a
    segment holding a snapshot of the 3-rank job, a newer one, one being sent, or a just-allocated one stays."""
    import os

    from flashckpt.format.segment import COMPLETE, FLAG_FETCHED, FLAG_SENDING, Segment, SlotHeader, segment_path
    from flashckpt.saver.server import CheckpointSaver

    job = tmp_path / "job"
    job.mkdir()
    saver = CheckpointSaver(str(job), str(tmp_path / "ckpt"))

    def own(lr: int, epoch: int, slots: list[tuple[int, int, int, float]], flags: int = 0) -> str:
        """A segment of local rank ``lr``: slots of (rank, world, step, wall time)."""
        path = segment_path(saver.job_dir, lr, epoch)
        Segment.create(path, local_rank=lr, epoch=epoch, nslots=2, meta_cap=4096, data_cap=4096)
        seg = saver.pool.segment(path)
        for i, (rank, world, step, t) in enumerate(slots):
            seg.write_header(i, SlotHeader(COMPLETE, flags, step, 1, 0, 0, 0, 0, t, step, rank + 1, world))
        return path

    writer = own(0, 0, [(0, 3, 21, 21.0), (0, 4, 17, 17.0)])  # the new job's rank 0 writes here: stays
    fetched = own(0, 1, [(3, 4, 17, 17.0)], flags=FLAG_FETCHED)  # old rank 3, fetched for the load
    gone = own(1, 0, [(1, 4, 17, 17.0), (1, 4, 16, 16.0)])  # local rank 1: the 3-rank job has one per node
    sending = own(1, 1, [(1, 4, 15, 15.0)], flags=FLAG_SENDING)
    fresh = own(2, 0, [])  # allocated, nothing in it yet
    newer = own(3, 0, [(2, 4, 25, 25.0)])  # taken after the newest commit: not older than it
    bak = _backup(saver, 3, 17)  # (world 0: not recorded; stays)
    bak4 = os.path.join(saver.job_dir, "bak-r00002-e000000.shm")
    Segment.create(bak4, local_rank=100_002, epoch=0, nslots=2, meta_cap=4096, data_cap=4096)
    saver.pool.segment(bak4).write_header(0, SlotHeader(COMPLETE, 0, 17, 1, 0, 0, 0, 0, 17.0, 17, 3, 4))

    assert saver.pool.other_layouts(3) == 25.0 and saver.pool.other_layouts(0) == 0.0
    removed, freed = saver.pool.release_layouts(3, before=20.0)  # the newest commit: snapshots taken at 20
    assert sorted(removed) == sorted([fetched, gone, bak4]) and freed > 0
    for p in (writer, sending, fresh, newer, bak):
        assert os.path.exists(p), p
    for p in removed:
        assert not os.path.exists(p), p
