"""Abort + retry policy: bounded retries, another instance preferred, capped backoff, Prometheus counters."""

from __future__ import annotations

import re

import pytest

from layersplit.pd.spec.monitor_config import RetryPolicy
from layersplit.pd.spec.retry import GIVE_UP, RETRY, CONTINUE, MonitorCounters, RetryController, backoff_delay, pick_instance
from layersplit.pd.spec.metrics import SpecSnapshot
from layersplit.pd.spec.monitor import GARBLED, HEALTHY, REPETITION, Verdict

SNAP = SpecSnapshot("trace", 0, 0, None, None)


def verdict(kind: str) -> Verdict:
    return Verdict(kind, f"test {kind}", SNAP)


class FakeRouter:
    def __init__(self, names=("d0", "d1", "d2")):
        self.names, self.calls = list(names), []

    def instances(self):
        return self.names

    def abort(self, rid, instance, reason):
        self.calls.append(("abort", rid, instance))

    def retry(self, rid, instance, delay_s):
        self.calls.append(("retry", rid, instance, delay_s))


@pytest.mark.parametrize("max_retries", [0, 1, 2, 5])
def test_retries_are_bounded(max_retries):
    router = FakeRouter()
    ctl = RetryController(router, RetryPolicy(max_retries=max_retries))
    instance, kinds = "d0", []
    for _ in range(max_retries + 3):
        action = ctl.on_verdict("r", instance, verdict(GARBLED))
        kinds.append(action.kind)
        instance = action.instance or instance
    assert kinds == [RETRY] * max_retries + [GIVE_UP] * 3
    assert sum(c[0] == "retry" for c in router.calls) == max_retries == ctl.retries("r")
    assert sum(c[0] == "abort" for c in router.calls) == max_retries + 3  # every anomaly aborts
    assert ctl.counters.exhausted[GARBLED] == 3 and ctl.counters.retries[GARBLED] == max_retries


def test_retry_prefers_other_instances_then_least_recent():
    router = FakeRouter()
    ctl = RetryController(router, RetryPolicy(max_retries=4, backoff_initial_s=0.5, backoff_multiplier=2.0,
                                              backoff_max_s=3.0))
    instance, seen = "d1", []
    for _ in range(4):
        action = ctl.on_verdict("r", instance, verdict(REPETITION))
        seen.append((action.instance, action.delay_s, action.attempt))
        instance = action.instance
    # untried first in router order, then the least recently tried one that is not the current
    assert seen == [("d0", 0.5, 1), ("d2", 1.0, 2), ("d1", 2.0, 3), ("d0", 3.0, 4)]


@pytest.mark.parametrize("instances,history,prefer,expected", [
    (["a"], ["a"], True, "a"),
    (["a", "b"], ["a"], False, "a"),
    (["a", "b"], ["b"], True, "a"),
    (["a", "b", "c"], ["a", "b", "c"], True, "a"),
    (["a", "b", "c"], ["c", "a", "b"], True, "c"),
    (["a", "b"], [], True, "a"),
], ids=["single-instance", "no-preference", "other", "all-tried-oldest", "all-tried-rotated", "no-history"])
def test_pick_instance(instances, history, prefer, expected):
    assert pick_instance(instances, history, prefer) == expected


def test_pick_instance_needs_an_instance():
    with pytest.raises(ValueError, match="expected at least one serving instance, got none"):
        pick_instance([], ["a"], True)


@pytest.mark.parametrize("n,expected", [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (6, 8.0), (20, 8.0)])
def test_backoff_is_exponential_and_capped(n, expected):
    assert backoff_delay(RetryPolicy(), n) == expected


def test_backoff_rejects_retry_zero():
    with pytest.raises(ValueError, match="expected an int >= 1, got 0"):
        backoff_delay(RetryPolicy(), 0)


def test_healthy_verdict_continues_and_only_counts():
    router = FakeRouter()
    ctl = RetryController(router, RetryPolicy())
    action = ctl.on_verdict("r", "d0", verdict(HEALTHY))
    assert action.kind == CONTINUE and action.instance == "d0" and router.calls == []
    assert ctl.counters.verdicts[HEALTHY] == 1 and not ctl.counters.aborts


def test_finished_resets_the_budget():
    ctl = RetryController(FakeRouter(), RetryPolicy(max_retries=1))
    assert ctl.on_verdict("r", "d0", verdict(GARBLED)).kind == RETRY
    ctl.finished("r")
    assert ctl.on_verdict("r", "d1", verdict(GARBLED)).kind == RETRY


def test_prometheus_exposition():
    counters = MonitorCounters()
    ctl = RetryController(FakeRouter(), RetryPolicy(max_retries=1), counters)
    for kind in (HEALTHY, HEALTHY, GARBLED, REPETITION):
        ctl.on_verdict(f"r-{kind}", "d0", verdict(kind))
    ctl.on_verdict("r-garbled", "d1", verdict(GARBLED))  # second anomaly: retries exhausted
    text = counters.to_prometheus()
    assert text.endswith("\n")
    for line in text.splitlines():
        assert re.fullmatch(r'# (HELP|TYPE) pd_spec_monitor_\w+ .+|pd_spec_monitor_\w+_total\{verdict="\w+"\} \d+', line), line
    assert "# TYPE pd_spec_monitor_verdicts_total counter" in text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples['pd_spec_monitor_verdicts_total{verdict="healthy"}'] == "2"
    assert samples['pd_spec_monitor_verdicts_total{verdict="garbled"}'] == "2"
    assert samples['pd_spec_monitor_aborts_total{verdict="garbled"}'] == "2"
    assert samples['pd_spec_monitor_retries_total{verdict="garbled"}'] == "1"
    assert samples['pd_spec_monitor_retries_exhausted_total{verdict="garbled"}'] == "1"
    assert samples['pd_spec_monitor_retries_exhausted_total{verdict="repetition"}'] == "0"
