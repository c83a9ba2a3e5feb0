"""Automatic checkpoint intervals: the pure functions against the closed forms."""

import math

import pytest
from flashckpt.engine.interval import (
    AutoIntervals,
    daly_interval,
    expected_goodput,
    mtbf_from_failures_per_day,
    optimal_interval,
    young_interval,
)


@pytest.mark.parametrize("cost,mtbf", [(0.01, 3600.0), (1.0, 86400.0), (30.0, 7200.0), (5.0, 50.0)])
def test_daly_matches_closed_form(cost, mtbf):
    x = math.sqrt(cost / (2 * mtbf))
    expect = math.sqrt(2 * cost * mtbf) * (1 + x / 3 + x * x / 9) - cost
    assert daly_interval(cost, mtbf) == pytest.approx(expect, rel=1e-12)
    assert young_interval(cost, mtbf) == pytest.approx(math.sqrt(2 * cost * mtbf), rel=1e-12)


def test_daly_when_cost_dominates_is_mtbf():
    assert daly_interval(100.0, 40.0) == 40.0


def test_daly_is_near_the_numerical_optimum_of_the_waste_model():
    cost, mtbf = 2.0, 3600.0

    def waste(tau):
        return 1 - expected_goodput(interval_s=tau, cost_s=cost, mtbf_s=mtbf)

    best = min((waste(t / 10), t / 10) for t in range(10, 20000))[1]
    assert daly_interval(cost, mtbf) == pytest.approx(best, rel=0.05)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        daly_interval(-1, 10)
    with pytest.raises(ValueError):
        daly_interval(1, 0)
    with pytest.raises(ValueError):
        mtbf_from_failures_per_day(-1)
    assert mtbf_from_failures_per_day(0) == math.inf
    assert mtbf_from_failures_per_day(2) == 43200.0


def test_two_levels_in_steps():
    c = optimal_interval(step_time_s=0.5, snapshot_cost_s=0.02, persist_cost_s=8.0,
                         process_mtbf_s=3600.0, node_mtbf_s=86400.0)
    assert c.memory_steps == round(daly_interval(0.02, 3600.0) / 0.5)
    assert c.storage_steps % c.memory_steps == 0
    assert c.storage_steps * 0.5 >= 8.0          # never persists faster than a persist takes
    assert c.storage_steps >= c.memory_steps
    assert 0.9 < c.expected_goodput < 1.0


def test_storage_interval_respects_persist_time():
    c = optimal_interval(step_time_s=1.0, snapshot_cost_s=0.01, persist_cost_s=500.0,
                         process_mtbf_s=600.0, node_mtbf_s=600.0)
    assert c.storage_interval_s >= 500.0


def test_no_failures_caps_intervals():
    c = optimal_interval(step_time_s=1.0, snapshot_cost_s=0.1, persist_cost_s=1.0,
                         process_mtbf_s=math.inf, node_mtbf_s=math.inf, max_steps=1000)
    assert (c.memory_steps, c.storage_steps) == (1000, 1000)
    assert c.expected_goodput == pytest.approx(1 - 0.1 / 1000.1)


def test_auto_intervals_follow_the_measured_costs():
    auto = AutoIntervals(process_mtbf_s=100.0, node_mtbf_s=1000.0)
    clock, kinds = 0.0, {}
    for step in range(1, 12):
        kind = auto.decide(step, clock)
        kinds[step] = kind
        pause = 0.01 if kind else 0.0
        if kind:
            auto.observe_snapshot(step, kind, pause)
        if kind == "storage":
            auto.observe_persist(2.0)
        clock += 1.0 + pause  # one second of training per step, plus our own pause
    # measure first (memory), then an early persist; then the optimum for step 1 s, pause 0.01 s:
    # memory every round(daly(0.01, 100) / 1) = 1 step, storage every round(daly(0.01, 1000) / 1) = 4 steps.
    assert auto.step_time_s == pytest.approx(1.0)
    assert (auto.choice.memory_steps, auto.choice.storage_steps) == (
        round(daly_interval(0.01, 100.0)), round(daly_interval(0.01, 1000.0)))
    assert [s for s, k in kinds.items() if k == "storage"] == [2, 6, 10]
    assert all(kinds[s] == "memory" for s in (1, 3, 4, 5, 7, 8, 9, 11))


def test_auto_intervals_need_a_failure_rate():
    with pytest.raises(ValueError, match="failure rate"):
        AutoIntervals(process_mtbf_s=math.inf, node_mtbf_s=math.inf)


def test_storage_type_for_fixed_intervals():
    from flashckpt import StorageType, storage_type_for

    assert [storage_type_for(s, 1, 10) for s in (1, 9, 10, 20)] == [StorageType.MEMORY, StorageType.MEMORY,
                                                                      StorageType.DISK, StorageType.DISK]
    assert storage_type_for(4, 2, 0) is StorageType.MEMORY and storage_type_for(5, 2, 0) is None
    assert storage_type_for(10, 0, 10) is StorageType.DISK and storage_type_for(3, 0, 10) is None
    assert storage_type_for(7, 0, 0) is None
