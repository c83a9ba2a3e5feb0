"""The typed control protocol (flashckpt.transport.messages): every request round-trips through its wire form, a
received object is checked field by field, and the saver's dispatch table serves every request type (an
unknown operation gets a ProtocolError reply naming the known ones, over a real connection)."""

from __future__ import annotations

import dataclasses

import pytest
from flashckpt import ProtocolError, StorageType
from flashckpt.saver.control import ControlServer
from flashckpt.transport import messages as M

EXAMPLES = [
    M.Hello(rank=3, local_rank=1, world_size=8, local_world_size=4, pid=123, persists=True,
            commit={"ranks": [0, 1], "world_size": 2, "replicated": False, "extra": {}}, agent_pid=9),
    M.Alloc(local_rank=0, meta_cap=4096, data_cap=1 << 20, nslots=2),
    M.Persist(step=5, rank=0, local_rank=0, seg_path="/dev/shm/x/seg-r0-e1.shm", slot=1, generation=7,
              path="/ckpt/step5.pt", commit=None, cursor=2),
    M.Status(local_rank=0, cursor=4), M.Status(), M.Wait(timeout_s=2.5, cursor=1), M.LastWords(timeout_s=None),
    M.DeleteSteps(steps=[1, 2], background=True), M.DeletePath(path="/ckpt/a"), M.GiveWay(dry_run=True),
    M.Bye(final=False, intent="keep"), M.QueuePut(name="q", item={"a": [1, 2]}), M.QueueGet(name="q", timeout_s=1),
    M.QueueSize(name="q"), M.DictUpdate(name="d", items={"k": 1}), M.DictGet(name="d"), M.Inventory(), M.Inspect(events=3),
    M.Fetch(local_rank=0, rank=1, step=7, sources=[{"host": "127.0.0.1", "port": 1}]), M.AwaitRecords(timeout_s=3.0),
]


def test_every_request_type_has_an_example_and_a_handler():
    assert {type(r) for r in EXAMPLES} == set(M.REQUESTS.values())
    assert set(ControlServer._DISPATCH) == set(M.REQUESTS.values())


@pytest.mark.parametrize("req", EXAMPLES, ids=lambda r: r.OP)
def test_a_request_round_trips_through_its_wire_form(req):
    import json

    wire = json.loads(json.dumps(req.to_wire()))  # as it crosses the socket
    assert wire["op"] == req.OP
    assert M.parse_request(wire) == req


@pytest.mark.parametrize("msg, says", [
    ({"op": "no_such_op"}, "unknown operation 'no_such_op'"),
    ({"rank": 0}, "unknown operation None"),
    ({"op": "hello"}, "the field 'rank' is missing"),
    ({"op": "hello", "rank": "x", "local_rank": 0}, "field 'rank'='x': a number is needed"),
    ({"op": "alloc", "local_rank": 0, "meta_cap": 1.5, "data_cap": 1}, "an integer is needed"),
    ({"op": "d_update", "name": "d", "items": [1]}, "an object is needed"),
    ({"op": "delete_steps", "steps": [1, "two"]}, "field 'steps'"),
    ({"op": "bye", "final": 1}, "a boolean is needed"),
])
def test_a_malformed_request_is_a_protocol_error_that_names_the_field(msg, says):
    with pytest.raises(ProtocolError, match=says.replace("(", r"\(").replace("[", r"\[")):
        M.parse_request(msg)


def test_numbers_are_converted_to_the_annotated_type():
    req = M.parse_request({"op": "wait", "timeout_s": 3, "cursor": 2.0})
    assert isinstance(req, M.Wait) and isinstance(req.timeout_s, float) and type(req.cursor) is int


def test_the_saver_answers_an_unknown_operation_with_a_protocol_error(make_engine):
    eng = make_engine()
    eng.save(1, {"w": 1}, storage_type=StorageType.MEMORY)
    client = eng._link.client  # the engine's connection to its real saver; no public accessor
    with pytest.raises(ProtocolError, match="unknown operation 'frobnicate'.*known: alloc"):
        client.call("frobnicate", x=1)
    reply = client.request(M.Status(cursor=0))
    assert isinstance(reply, M.StatusReply) and reply.committed == []  # the connection is still served
    assert dataclasses.is_dataclass(reply)
    eng.close()


def test_every_request_is_answered_with_its_typed_reply(make_engine, ckpt_dir):
    """Each request type names its reply type (``REPLY``); the real saver answers with it and the client
    returns it converted, for every request a client may send outside a save (persists: test_engine)."""
    import os

    eng = make_engine()
    eng.save(1, {"w": 1}, storage_type=StorageType.DISK)
    eng.wait(60)
    client = eng._link.client  # the engine's connection to its real saver; no public accessor
    asked = [M.Hello(rank=0, local_rank=0, pid=os.getpid()), M.Status(cursor=0), M.Wait(timeout_s=5),
             M.LastWords(timeout_s=5), M.DeleteSteps(steps=[99]), M.DeleteSteps(steps=[98], background=True),
             M.DeletePath(path=os.path.join(ckpt_dir, "nothing-here")), M.GiveWay(dry_run=True),
             M.QueuePut(name="q", item=[1]), M.QueueSize(name="q"), M.QueueGet(name="q"),
             M.DictUpdate(name="d", items={"k": 2}), M.DictGet(name="d")]
    replies = {type(r).__name__: client.request(r) for r in asked}
    for req in asked:
        assert type(replies[type(req).__name__]) is type(req).REPLY, req
    assert replies["Hello"].pid == eng._link.saver_pid and replies["Status"].committed == [1]
    assert replies["LastWords"].step is None and replies["DeleteSteps"].scheduled == [98]
    assert replies["DeletePath"].missing and replies["QueueGet"].item == [1] and replies["QueueSize"].size == 1
    assert replies["DictGet"].items == {"k": 2} and replies["GiveWay"].idle is False
    eng.close()


def test_a_reply_of_the_wrong_structure_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="AllocReply.*'path' is missing"):
        M.AllocReply.from_wire({"ok": True})
    with pytest.raises(ProtocolError, match="'deleted'.*a list is needed"):
        M.DeleteStepsReply.from_wire({"ok": True, "deleted": 3})
