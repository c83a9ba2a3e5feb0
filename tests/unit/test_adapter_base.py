"""The adapter base (flashckpt.engine.adapter) and its process-group helper (flashckpt.engine.collective):
the load protocol every adapter runs (memory, the storage fall-back and why, nothing to load, a damaged
snapshot) on a real engine, and the error gather naming each failed rank with real gloo ranks."""

from __future__ import annotations

import logging

import pytest
import torch
from flashckpt import StorageType
from flashckpt.engine.adapter import AdapterBase, LoadAttempt, Opened, resolve_load
from flashckpt.engine.collective import RankFailures, gather_errors, raise_failures
from flashckpt.engine.engine import Located
from flashckpt.errors import CheckpointCorruptError
from helpers import run_ranks


class _Adapter(AdapterBase):
    """The smallest adapter: opens a step from memory as the snapshot itself, from storage with ``load``."""

    def __init__(self, engine):
        self.engine = engine

    def load(self, *, refuse=None, memory=None):
        def from_memory(loc, sd):
            return Opened(sd, loc.step, loc.path) if memory is None else memory(loc, sd)

        def from_storage(attempt: LoadAttempt):
            loc = attempt.stored()
            return None if loc.step is None else Opened(self.engine.load(loc.path), loc.step, loc.path)

        return self.resolve_load(op="load()", event="test_load", refuse=refuse, from_memory=from_memory,
                                 from_storage=from_storage)


def _saved(make_engine, memory_step: int | None = 2):
    engine = make_engine()
    engine.save(1, {"w": torch.ones(4)}, storage_type=StorageType.DISK)
    engine.wait(60)
    if memory_step is not None:
        engine.save(memory_step, {"w": torch.full((4,), 2.0)}, storage_type=StorageType.MEMORY)
    return engine


def test_resolve_load_from_memory_records_and_logs(make_engine, caplog):
    engine = _saved(make_engine)
    with _Adapter(engine) as ad, caplog.at_level(logging.INFO, logger="flashckpt.engine.adapter"):
        r = ad.load()
        assert (r.source, r.step, r.why_not_memory, r.located.source) == ("memory", 2, "", "memory")
        assert torch.equal(r.value["w"], torch.full((4,), 2.0)) and r.nbytes >= 16
        assert r.result().source == "memory" and r.result().step == 2
    assert "event=test_load step=2 source=memory" in caplog.text


def test_refused_memory_falls_back_to_the_newest_committed_step_with_the_reason(make_engine, caplog):
    engine = _saved(make_engine)
    with _Adapter(engine) as ad, caplog.at_level(logging.INFO, logger="flashckpt.engine.adapter"):
        r = ad.load(refuse=lambda loc: "another tag is asked for")
        assert (r.source, r.step, r.why_not_memory) == ("storage", 1, "another tag is asked for")
        assert torch.equal(r.value["w"], torch.ones(4))
        # the opener's own reason (a collective opener that cannot serve, the same on every rank)
        r = ad.load(memory=lambda loc, sd: "the layout differs")
        assert (r.source, r.step, r.why_not_memory) == ("storage", 1, "the layout differs")
    assert "in memory, but another tag is asked for; loading from storage" in caplog.text
    assert "load(): the layout differs; loading from storage" in caplog.text


def test_nothing_to_load_is_source_none(make_engine):
    with _Adapter(make_engine()) as ad:
        r = ad.load()
        assert (r.value, r.step, r.source, r.path, r.why_not_memory) == (None, None, "none", None, "")


def test_a_damaged_snapshot_is_read_from_storage_and_says_why(make_engine, monkeypatch):
    engine = _saved(make_engine)

    def damaged(step, **kw):
        raise CheckpointCorruptError(f"the snapshot of step {step} is damaged")

    monkeypatch.setattr(engine, "load_memory", damaged)
    with _Adapter(engine) as ad:
        r = ad.load()
    assert (r.source, r.step) == ("storage", 1) and torch.equal(r.value["w"], torch.ones(4))
    assert r.why_not_memory == ("step 2 cannot be read from memory on ranks {0: 'CheckpointCorruptError: the "
                                "snapshot of step 2 is damaged'}")


class _Closing:
    def __init__(self) -> None:
        self.closed: list[bool] = []
        self.waited: list[float | None] = []

    def close(self, release: bool = True) -> None:
        self.closed.append(release)

    def wait(self, timeout: float | None = None) -> None:
        self.waited.append(timeout)


def test_wait_close_and_a_with_block_that_raises_keeps_the_snapshots():
    eng = _Closing()
    with _Adapter(eng) as ad:
        ad.wait(5)
    with pytest.raises(ValueError, match="boom"), _Adapter(eng):
        raise ValueError("boom")
    assert eng.waited == [5] and eng.closed == [True, False]


class _FakeEngine:
    """Locates step 3 in memory on every rank; ``bad`` ranks cannot read their snapshot."""

    def __init__(self, bad: set[int], r: int) -> None:
        self.bad, self.r, self.last_load, self.process_group = bad, r, None, None
        self.relocated = 0

    def locate(self, *, memory: bool = True, local: bool = False, reshard: bool = False) -> Located:
        if not memory:
            self.relocated += 1
            return Located(2, "storage", "/ckpt/2")
        return Located(3, "memory", "/ckpt/3")

    def load_memory(self, step):
        if self.r in self.bad:
            raise OSError(f"rank {self.r} lost its segment")
        return {"step": step}


def ranks_worker() -> dict:
    import torch.distributed as dist

    r = dist.get_rank()
    out: dict = {}
    out["gathered"] = {str(k): v for k, v in gather_errors(ValueError("bad") if r != 1 else None).items()}
    raise_failures("nothing", None)  # no rank failed: returns on every rank
    try:
        raise_failures("reading step 3", OSError(f"disk {r}") if r in (0, 2) else None)
    except RankFailures as e:
        out["raised"] = [str(e), sorted(e.failures)]
    eng = _FakeEngine({2}, r)
    res = resolve_load(eng, op="load()", event="x", from_memory=lambda loc, sd: Opened(sd, loc.step),
                       from_storage=lambda a: Opened("stored", a.stored().step))
    out["load"] = [res.source, res.step, res.value, res.why_not_memory, eng.relocated]
    return out


@pytest.mark.multiproc
def test_rank_errors_are_gathered_and_raised_on_every_rank_naming_each(tmp_path):
    results = run_ranks(ranks_worker, 3, str(tmp_path / "ranks"), timeout=240)
    for out in results:
        assert out["gathered"] == {"0": "ValueError: bad", "2": "ValueError: bad"}
        message, failed = out["raised"]
        assert failed == [0, 2]
        assert message == "reading step 3 failed on ranks {0: 'OSError: disk 0', 2: 'OSError: disk 2'}"
        # rank 2's damaged snapshot sends every rank to storage, each knowing why
        assert out["load"] == ["storage", 2, "stored",
                               "step 3 cannot be read from memory on ranks {2: 'OSError: rank 2 lost its segment'}", 1]
