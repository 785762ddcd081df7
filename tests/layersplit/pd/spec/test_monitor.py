"""Rule edges: exactly 128 tokens, exactly 1.4, exactly 0.96 do not fire; one step beyond does."""

from __future__ import annotations

import dataclasses

import pytest

from layersplit.pd.spec.monitor_config import GarbledRule, MonitorConfig, RepetitionRule, load_monitor_config
from layersplit.pd.spec.metrics import snapshot_from_meta
from layersplit.pd.spec.monitor import GARBLED, HEALTHY, REPETITION, SpecMonitor, judge


def config(window: int = 32, garbled_signal: str = "cumulative", repetition_signal: str = "cumulative",
           min_steps: int = 32) -> MonitorConfig:
    return MonitorConfig(window_steps=window, garbled=GarbledRule(1.4, 128, garbled_signal),
                         repetition=RepetitionRule(0.96, min_steps, repetition_signal))


def run(cfg: MonitorConfig, accepted: list[int], draft_tokens: int = 4):
    monitor = SpecMonitor(cfg)
    verdict = None
    for a in accepted:
        verdict = monitor.observe("r", draft_tokens, a)
    return verdict


# (accepted per step with draft_tokens 4, expected verdict): cumulative rules
EDGES = {
    # 100 steps, 28 accepted: 128 tokens, length 1.28 < 1.4 but not > 128 tokens
    "exactly-128-tokens": ([1] * 28 + [0] * 72, HEALTHY),
    "129-tokens": ([1] * 28 + [0] * 73, GARBLED),  # 129 / 101 = 1.277
    # 100 steps, 40 accepted: 140 tokens, length exactly 1.4
    "length-exactly-1.4": ([1] * 40 + [0] * 60, HEALTHY),
    "length-1.396": ([1] * 40 + [0] * 61, GARBLED),  # 141 / 101
    "length-1.39": ([1] * 39 + [0] * 61, GARBLED),  # 139 / 100
    # 50 steps x 3 drafts = 150 proposed, 144 accepted: rate exactly 0.96 (rising to it, never above)
    "rate-exactly-0.96": ([2] * 6 + [3] * 44, HEALTHY),
    "rate-0.9667": ([2] * 5 + [3] * 45, REPETITION),  # 145 / 150
    "rate-0.9608-one-more-step": ([2] * 6 + [3] * 44 + [3], REPETITION),  # 147 / 153
}


@pytest.mark.parametrize("case", list(EDGES))
def test_cumulative_rule_edges(case):
    accepted, expected = EDGES[case]
    verdict = run(config(), accepted)
    assert verdict.kind == expected, verdict.reason


def test_min_verify_steps_is_inclusive():
    assert run(config(min_steps=32), [3] * 31).kind == HEALTHY
    verdict = run(config(min_steps=32), [3] * 32)
    assert verdict.kind == REPETITION and "after 32 verify steps (>= 32)" in verdict.reason


def test_window_garbled_edges():
    cfg = config(window=5, garbled_signal="window")
    healthy_prefix = [2] * 50  # 150 tokens: length 3, rate 0.667
    edge = run(cfg, healthy_prefix + [1, 0, 1, 0, 0])  # window: 7 tokens / 5 steps = 1.4
    assert edge.kind == HEALTHY and edge.numbers["window_accept_length"] == 1.4
    beyond = run(cfg, healthy_prefix + [1, 0, 1, 0, 0, 0])  # window [0, 1, 0, 0, 0]: 6 / 5
    assert beyond.kind == GARBLED and beyond.reason.startswith("window of 5 steps accept length 1.2000 (6/5)")
    assert run(config(window=5, garbled_signal="cumulative"), healthy_prefix + [0] * 6).kind == HEALTHY


def test_window_repetition_edges():
    cfg = config(window=25, repetition_signal="window", min_steps=1)
    base = [0] * 40  # cumulative rate stays low
    assert run(cfg, base + [1] * 24 + [0], draft_tokens=2).kind == HEALTHY  # window 24 / 25 = 0.96
    assert run(cfg, base + [0] + [1] * 25, draft_tokens=2).kind == REPETITION  # window 25 / 25


def test_any_signal_uses_either():
    cfg = config(window=5, garbled_signal="any")
    assert run(cfg, [2] * 50 + [0] * 6).kind == GARBLED  # window fires, cumulative does not
    assert run(cfg, [1] * 28 + [0] * 73).kind == GARBLED  # cumulative fires


@pytest.mark.parametrize("rate,expected", [(0.96, HEALTHY), (0.9600000000000001, REPETITION), (0.97, REPETITION)],
                         ids=["exactly-0.96", "one-ulp-above", "0.97"])
def test_meta_info_rate_edge(rate, expected):
    snap = snapshot_from_meta({"completion_tokens": 194, "spec_verify_ct": 50, "spec_accept_rate": rate})
    assert judge(snap, config()).kind == expected


@pytest.mark.parametrize("completion,expected", [(128, HEALTHY), (129, GARBLED), (140, HEALTHY), (139, GARBLED)],
                         ids=["128-tokens", "129-tokens", "length-1.4", "length-1.39"])
def test_meta_info_garbled_edges(completion, expected):
    steps = 100
    snap = snapshot_from_meta({"completion_tokens": completion, "spec_verify_ct": steps})
    assert judge(snap, config()).kind == expected


def test_window_only_rule_ignores_meta_info():
    snap = snapshot_from_meta({"completion_tokens": 200, "spec_verify_ct": 190, "spec_accept_rate": 0.01})
    cfg = config(garbled_signal="window")
    assert judge(snap, cfg).kind == HEALTHY
    assert judge(snap, dataclasses.replace(cfg, garbled=GarbledRule(1.4, 128, "any"))).kind == GARBLED


def test_verdict_carries_reason_and_numbers():
    verdict = run(load_monitor_config(), [0] * 140)
    assert verdict.kind == GARBLED and verdict.anomalous
    assert verdict.reason == "cumulative accept length 1.0000 (129/129) < 1.4 after 129 generated tokens (> 128)"
    assert verdict.numbers == {"generated": 129, "verify_steps": 129, "accept_length": 1.0, "accept_rate": 0.0,
                               "window_accept_length": 1.0, "window_accept_rate": 0.0, "window_steps": 32}
    assert verdict.to_dict()["verdict"] == GARBLED


def test_monitor_latches_first_anomaly_and_forgets_on_finish():
    monitor = SpecMonitor(config())
    for _ in range(129):
        first = monitor.observe("a", 4, 0)
    assert first.kind == GARBLED
    for _ in range(100):
        later = monitor.observe("a", 4, 3)  # recovers, but the request is already condemned
    assert later is first and monitor.finish("a") is first
    assert monitor.active() == 0 and monitor.verdict("a").kind == HEALTHY
    assert "no verify steps" in monitor.verdict("never-seen").reason


def test_requests_are_independent():
    monitor = SpecMonitor(config())
    for _ in range(129):
        monitor.observe("bad", 4, 0)
        monitor.observe("good", 4, 2)
    assert monitor.verdict("bad").kind == GARBLED and monitor.verdict("good").kind == HEALTHY


@pytest.mark.parametrize("case,key,value", [("exactly-128-tokens", "generated", 128),
                                            ("length-exactly-1.4", "accept_length", 1.4),
                                            ("rate-exactly-0.96", "accept_rate", 0.96)],
                         ids=["128-tokens", "length-1.4", "rate-0.96"])
def test_edge_cases_really_sit_on_the_edge(case, key, value):
    assert run(config(), EDGES[case][0]).numbers[key] == value
