"""``DurabilityPolicy``'s bookkeeping on its own: the lag from the oldest save storage still owes, what a
durable commit settles, the refusal of bad arguments (end to end: tests/multiproc/test_durability.py)."""

from __future__ import annotations

import pytest
from flashckpt import DurabilityLagError, InvalidArgumentError
from flashckpt.engine.durability import DurabilityPolicy


def test_the_lag_runs_from_the_oldest_step_storage_owes() -> None:
    p = DurabilityPolicy("raise", 10.0, "/ckpt")
    assert p.lag_s(100.0) == 0.0
    p.saved(1, True, at=100.0)
    p.saved(2, False, at=101.0)  # a memory save owes storage nothing
    p.saved(3, True, at=103.0)
    assert p.lag_s(104.0) == 4.0 and p.report(104.0).pending == (1, 3)
    p.observe([1], [{"step": 1, "tier": "durable", "lag_s": 0.5}])
    assert p.lag_s(104.0) == 1.0 and p.report(104.0).pending == (3,) and p.report().commit_lags == {1: 0.5}
    p.check_lag(112.0)  # 9 s: within the bound
    with pytest.raises(DurabilityLagError, match=r"14 s behind .* steps \[3\].*step 1 committed in /ckpt"):
        p.check_lag(117.0)
    p.observe([1], [{"step": 3, "tier": "local", "lag_s": 0.1}])  # on the node's disk: still owed to storage
    assert p.report(104.0).local_step == 3 and p.report(104.0).pending == (3,)
    assert "step 3 committed on the node's local tier" in p.safe()
    p.observe([1, 5], [])  # a newer durable step settles every save up to it
    assert p.lag_s(200.0) == 0.0 and p.report().durable_step == 5
    p.check_lag(200.0)


def test_warn_logs_instead_of_raising() -> None:
    p = DurabilityPolicy("warn", 1.0, "/ckpt")
    p.saved(1, True, at=0.0)
    assert p.failed("1 persist(s) failed: x", 1) is False
    p.check_lag(50.0)  # logged, not raised
    assert p.report().failures == 1
    assert DurabilityPolicy("raise", None, "/ckpt").failed("x", 1) is True


def test_a_retried_upload_is_reported_once_until_it_is_durable() -> None:
    p = DurabilityPolicy("warn", None, "/ckpt")
    retry = {"step": 4, "error": "x", "tier": "durable", "retrying": True}
    assert [p.first_report(retry) for _ in range(3)] == [True, False, False]
    assert p.first_report({"step": 4, "error": "y"})  # a failure of another kind counts each time
    p.observe([4], [])
    assert p.first_report(retry)  # step 4 durable meanwhile: a later failure of it is news again


@pytest.mark.parametrize("kw", [{"on_error": "ignore"}, {"max_lag_s": -1.0}, {"max_lag_s": "5"}])
def test_bad_arguments_are_refused(kw: dict) -> None:
    args = {"on_error": "raise", "max_lag_s": None, **kw}
    with pytest.raises(InvalidArgumentError):
        DurabilityPolicy(args["on_error"], args["max_lag_s"], "/ckpt")


def test_an_unreadable_checkpoint_dir_is_left_alone_for_the_back_off_and_logged_once(caplog) -> None:
    """Under "warn", a save that found the store unreadable makes the saves of the next UNREADABLE_BACKOFF_S
    memory snapshots at once (owed, counted, not logged again); after it the store is asked again (still down:
    counted, another back-off, not logged again), and reading it again is said once."""
    from flashckpt.engine.durability import UNREADABLE_BACKOFF_S

    p = DurabilityPolicy("warn", None, "s3://b/run")
    assert not p.unreadable(0.0)
    with caplog.at_level("WARNING", logger="flashckpt.engine"):
        p.not_readable(4, "S3 ListObjectsV2 gave up after 20 s", now=100.0)
        assert p.unreadable(100.0 + UNREADABLE_BACKOFF_S - 1) and not p.unreadable(100.0 + UNREADABLE_BACKOFF_S)
        p.not_readable(8, "s3://b/run could not be read a moment ago", now=110.0)  # within the back-off
        assert not p.unreadable(100.0 + UNREADABLE_BACKOFF_S)  # not extended: the store is asked again then
        p.not_readable(12, "S3 ListObjectsV2 gave up after 20 s", now=100.0 + UNREADABLE_BACKOFF_S)  # still down
        assert p.unreadable(100.0 + 2 * UNREADABLE_BACKOFF_S - 1)
        p.readable()
        p.readable()
    assert caplog.text.count("is not persisted") == 1 and "save(step=4)" in caplog.text  # once per outage
    assert caplog.text.count("can be read again") == 1
    assert p.report().failures == 3 and p.report().pending == (4, 8, 12) and not p.unreadable(111.0)
