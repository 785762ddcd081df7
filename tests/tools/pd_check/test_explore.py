"""The exhaustive checker (tools.pd_check): the CI bound explores every interleaving with no violation; with
the legacy immediate release and with each hardening guard off it finds a counterexample (breadth-first:
a shortest one); the saved counterexamples replay as regression tests — unsafe they break the protocol
again, safe the same schedule is harmless."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from tools.pd_check import (CheckBounds, format_trace, load_counterexample, replay, run_check, save_counterexample,
                            shortest)
from tools.pd_check import por
from tools.pd_check.explorer import _quiet
from tools.pd_check.por import unsound_independence, unsound_quiet
from tools.pd_check.state import every_renaming, fingerprint, orbit_fingerprint, symmetries, unclassified
from tools.pd_check.world import apply, build_world, enabled, label
from layersplit.pd.abort.guards import GUARDS, guards_off

DATA = Path(__file__).parent / "data" / "check"

# ~5,700 states, ~25 s on the shared 2 cores: 2 LayerSplit prefill ranks, one request that a client may cancel
# at any moment and decode may time out at any moment, every order of every event and delivery
CI_BOUND = CheckBounds(prefill_ranks=2, requests=1, faults=0, retries=0, cancels=1, polls=0, channel_capacity=1)

ISSUE_20_FAULTS = ("drop", "duplicate", "reorder", "crash", "fail")  # the faults these races need (and were found with)

# the smallest bounds at which each unsafe variant breaks (one rank where the race needs only one)
TEETH = {
    "legacy": dict(requests=1, faults=0, cancels=0, retries=0, legacy=True),
    "idempotent-abort": dict(requests=1, faults=0, cancels=1, retries=0),
    "release-unannounced-at-once": dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0,
        fault_kinds=ISSUE_20_FAULTS),
    "fan-in-every-rank": dict(requests=1, faults=0, cancels=0, retries=0),
    "quarantine-at-bound": dict(requests=1, faults=0, cancels=0, retries=0),
    "sources-held-until-drained": dict(requests=1, faults=0, cancels=0, retries=0),
    "restart-drains-first": dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0, polls=0,
        fault_kinds=ISSUE_20_FAULTS),
    "prune-below-floor": dict(prefill_ranks=1, requests=2, faults=0, cancels=0, retries=0, polls=0),
    "floor-rejects-late": dict(prefill_ranks=1, requests=2, faults=1, cancels=0, retries=0, polls=0, abort_sends=1,
        fault_kinds=("duplicate",)),  # the late duplicate it needs
    "incarnation-address": dict(prefill_ranks=1, requests=1, faults=2, cancels=0, retries=0, polls=0,
        fault_kinds=ISSUE_20_FAULTS),
    # issue 25: each with the one fault kind its race needs
    "quarantine-heals": dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0, polls=0, abort_sends=1,
                             fault_kinds=("drop",)),
    "fence-refuses-writes": dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0, polls=0,
                                 fault_kinds=("kill",)),
    "decode-life-fence": dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0, polls=0,
                              fault_kinds=("decode_restart",)),
    "owners-only": dict(requests=1, faults=1, cancels=0, retries=0, polls=0, fault_kinds=("misaddress",)),
    "reply-from-its-peer": dict(requests=1, faults=1, cancels=0, retries=0, polls=0, fault_kinds=("misaddress",)),
}


# found by the CLI and recorded (13 steps, ~15,000 states, ~20-60 s here: too slow to search in CI); the replay
# below still proves it; tests/layersplit/pd/abort/test_decode_identity.py shows the same race scripted:
#   python -m tools.pd_check --prefill-ranks 1 --requests 1 --faults 1 --cancels 0 --retries 2 --polls 0 \
#     --abort-sends 1 --channel-capacity 1 --fault-kinds decode_restart --guard-off floor-per-decode-life
RECORDED_ONLY = ("floor-per-decode-life",)


def teeth_bounds(name: str) -> CheckBounds:
    kw = dict(TEETH[name])
    if name != "legacy":
        kw["guards_off"] = (name,)
    return CheckBounds(**kw)


def test_ci_bound_explores_every_interleaving_without_a_violation():
    result = run_check(CI_BOUND)
    assert result["violations"] == [] and result["counterexample"] is None
    assert result["complete"] and result["stopped"] is None
    assert 500 < result["states"] < 200_000 and result["depth"] > 10 and result["terminal_states"] > 0


@pytest.mark.parametrize("name", list(TEETH))
@pytest.mark.slow
def test_unsafe_variant_has_a_counterexample(name):
    """With every reduction on (partial order included) each unsafe variant still breaks; its shortest
    counterexample (a re-run without the partial-order reduction, if that one was in force) is never longer
    than the recorded one."""
    result = run_check(teeth_bounds(name))
    assert result["violations"], f"{name}: no counterexample at {TEETH[name]}"
    assert len(result["reductions"]) == 3
    ce = result["counterexample"]
    assert 0 < len(ce["trace"]) <= result["depth"] and "VIOLATION" in format_trace(ce)
    short = shortest(teeth_bounds(name), result)
    assert short["shortest"] and short["violations"] and len(short["counterexample"]["trace"]) <= len(ce["trace"])
    recorded = DATA / f"{name}.json"
    if not recorded.exists():  # first run: record it (then commit the file)
        save_counterexample(recorded, short)
    _, trace, violation = load_counterexample(recorded)
    assert len(short["counterexample"]["trace"]) <= len(trace), "never longer than the recorded shortest trace"


@pytest.mark.parametrize("name", list(TEETH) + list(RECORDED_ONLY))
def test_recorded_counterexample_replays(name):
    bounds, trace, violation = load_counterexample(DATA / f"{name}.json")
    unsafe = replay(bounds, trace)
    assert unsafe["diverged"] is None and unsafe["steps"] == len(trace)
    assert [v.split(":")[0] for v in unsafe["violation"]] == [v.split(":")[0] for v in violation]
    safe = replay(replace(bounds, legacy=False, guards_off=()), trace)  # the same schedule, every guard on
    assert safe["violation"] == [], safe


@pytest.mark.slow
def test_reductions_lose_no_state_class(symmetry=False, stale=False):
    """The run with every reduction reaches the same classes of states (states up to a renaming of ranks
    and request ids, blind to stale events) as the exhaustive one, in fewer states (each reduction alone:
    the same check, from the command line / the closing note of issue 25)."""
    bounds = CheckBounds(prefill_ranks=2, requests=1, faults=0, retries=0, cancels=0, polls=0, channel_capacity=1,
                         abort_sends=1, por=False)  # exhaustive: ~1,900 states, ~11 s here (POR: the test below)
    weaker, reduced = set(), set()
    plain = run_check(replace(bounds, symmetry=symmetry, stale_events=stale), weaker)
    both = run_check(bounds, reduced)
    assert plain["complete"] and both["complete"] and plain["violations"] == both["violations"] == []
    assert weaker == reduced and both["states"] == len(reduced) < plain["states"]
    assert len(both["reductions"]) == 2 and len(plain["reductions"]) == symmetry + stale


# the partial-order reduction keeps every terminal state class (and every violation), not every state: its
# cross-check compares terminal classes, at the CI bound (~1,300 states), at one with a fault (~2,400) and at
# one with two requests (~3,700: a quiet reply for one room is ordered once against the other room's steps)
POR_BOUNDS = {"ci": CI_BOUND,
              "fault": CheckBounds(prefill_ranks=2, requests=1, faults=1, retries=0, cancels=0, polls=0,
                                   channel_capacity=1, fault_kinds=("drop", "decode_restart")),
              "two_requests": CheckBounds(prefill_ranks=1, requests=2, faults=0, retries=0, cancels=0, polls=0,
                                          channel_capacity=1)}


def _terminal_classes(bounds: CheckBounds) -> tuple[dict, set]:
    found = set()
    return run_check(bounds, terminal_classes=found), found


@pytest.mark.parametrize("bound", list(POR_BOUNDS))
@pytest.mark.slow
def test_partial_order_reduction_keeps_every_terminal_class(bound):
    bounds = POR_BOUNDS[bound]
    plain, every = _terminal_classes(replace(bounds, por=False))
    reduced, kept = _terminal_classes(bounds)
    assert plain["complete"] and reduced["complete"] and plain["violations"] == reduced["violations"] == []
    assert kept == every and reduced["por_reduced_states"] > 0 and reduced["states"] < plain["states"]
    assert len(reduced["reductions"]) == 3 and len(plain["reductions"]) == 2


_SAME_FOR_ANY_WORKERS = ("states", "depth", "transitions", "terminal_states", "pruned_by_channel_capacity",
                         "por_reduced_states", "por_proviso_expansions", "frontier_sizes", "complete", "violations")


@pytest.mark.slow
def test_worker_processes_explore_exactly_the_serial_search():
    """Two forked workers per level (each level split into spans of a few states, merged in order) reach the
    same states, transitions, reduced states and proviso expansions, level by level, and the same classes:
    the duplicate check and the cycle proviso read the level's snapshot the serial search reads."""
    found = {}
    for workers in (1, 2):
        classes, terminal = set(), set()
        result = run_check(CI_BOUND, classes, terminal, workers=workers)
        found[workers] = ({k: result[k] for k in _SAME_FOR_ANY_WORKERS}, classes, terminal)
        assert result["workers"] == workers
    assert found[1] == found[2] and found[1][0]["complete"] and found[1][0]["por_proviso_expansions"] > 0


def test_worker_processes_find_the_same_shortest_counterexample():
    serial = run_check(teeth_bounds("legacy"))
    parallel = run_check(teeth_bounds("legacy"), workers=2)
    assert parallel["violations"] == serial["violations"] != []
    assert len(parallel["counterexample"]["trace"]) == len(serial["counterexample"]["trace"])
    assert replay(teeth_bounds("legacy"), parallel["counterexample"]["trace"])["violation"]


@pytest.mark.parametrize("workers", [0, -1, True, 1.5, "many"])
def test_bad_worker_counts_are_refused(workers):
    with pytest.raises(ValueError, match="workers: expected an integer >= 1 or 'auto'"):
        run_check(CI_BOUND, workers=workers)


def _wrong_entry_loses_classes(bounds: CheckBounds, wrong_entry) -> dict:
    """With ``wrong_entry`` on, the reduced run loses terminal classes the unreduced one has; without it, it
    keeps them all (returns that sound run's result)."""
    _, every = _terminal_classes(replace(bounds, por=False))
    with wrong_entry():
        wrong, kept = _terminal_classes(bounds)
    assert wrong["complete"] and kept < every
    result, sound = _terminal_classes(bounds)
    assert sound == every
    return result


@pytest.mark.slow
def test_a_wrong_independence_entry_fails_the_cross_check():
    """The reduction's teeth: declaring a rank's landing writes local (they read decode's page owner) and
    dropping the non-empty-queue condition prunes interleavings the protocol needs: terminal classes are lost."""
    _wrong_entry_loses_classes(POR_BOUNDS["ci"], unsound_independence)


@pytest.mark.parametrize("bound", ["fault", "two_requests"])
@pytest.mark.slow
def test_a_wrong_quiet_delivery_fails_the_cross_check(bound, monkeypatch):
    """The quiet-delivery set's teeth: taking every delivery into decode as quiet (a TransferDone from an
    owner completes a request, an AbortAck releases pages) loses terminal classes; the real set keeps them
    and is what reduces the search below the rank-local sets alone."""
    bounds = POR_BOUNDS[bound]
    quiet = _wrong_entry_loses_classes(bounds, unsound_quiet)
    monkeypatch.setattr(por, "_quiet_into_decode", lambda w, a: False)
    rank_local_only, _ = _terminal_classes(bounds)
    assert quiet["states"] < rank_local_only["states"]


def test_every_guard_has_teeth_or_is_a_detector():
    """Every guard is checked here, except the stale-free check, which no schedule reaches while the
    other guards hold (the checker's own free-list invariant watches the same thing)."""
    assert set(GUARDS) - set(TEETH) - set(RECORDED_ONLY) == {"free-by-owner-only"}


def test_guards_off_restores_the_protocol():
    from layersplit.pd.abort.room_book import RoomBook

    original = RoomBook.__dict__["below_floor"]
    with guards_off(["floor-rejects-late"]):
        assert RoomBook.__dict__["below_floor"] is not original
    assert RoomBook.__dict__["below_floor"] is original


def test_every_attribute_is_classified_for_hashing():
    with _quiet():
        world = build_world(CheckBounds(requests=2, faults=1))
        for _ in range(12):  # a few steps in, so requests and records exist
            apply(world, enabled(world)[0])
    assert unclassified(world) == []


def test_interleavings_of_independent_steps_hash_alike():
    """Delivering the TransferRequest to rank 0 then rank 1, or the other way round: one state."""
    world = build_world(CheckBounds(prefill_ranks=2, requests=1))
    for _ in range(2):  # submit, bootstrap lookup: the request is announced to both ranks
        apply(world, next(a for a in enabled(world) if a[0] == "event"))
    to_0, to_1 = [a for a in enabled(world) if a[0] == "deliver"]
    a, b = pickle.loads(pickle.dumps(world)), pickle.loads(pickle.dumps(world))
    apply(a, to_0), apply(a, to_1)
    apply(b, to_1), apply(b, to_0)
    assert fingerprint(a) == fingerprint(b) != fingerprint(world)
    apply(a, next(x for x in enabled(a) if x[0] == "event" and "prefill0: forward" in label(a, x)))
    assert fingerprint(a) != fingerprint(b)


@pytest.mark.slow
def test_candidate_renamings_give_the_orbit_classes():
    """The symmetry fingerprint minimises over the renamings that sort a naming-independent key, not over
    the whole group: over every state within 4 steps of the start at 2 ranks x 2 requests x 2 faults (then
    random walks from there) it splits states exactly as the least hash over every renaming does —
    including states equal only up to a renaming of ranks, or of request ids — and tries fewer renamings."""
    import random

    worlds, level = [], [build_world(CheckBounds(prefill_ranks=2, requests=2, faults=2))]
    with _quiet():
        for _ in range(4):
            nxt, seen = [], set()
            for w in level:
                for a in enabled(w):
                    child = pickle.loads(pickle.dumps(w))
                    apply(child, a)
                    if fingerprint(child) not in seen:
                        seen.add(fingerprint(child))
                        nxt.append(child)
            worlds += nxt
            level = nxt
        rng = random.Random(0)
        for w in rng.sample(level, 20):
            for _ in range(25):
                actions = enabled(w)
                if not actions:
                    break
                apply(w, rng.choice(actions))
                worlds.append(pickle.loads(pickle.dumps(w)))
    by_candidates, by_orbit, plain_in_orbit, tried, group = {}, {}, {}, 0, 0
    for i, w in enumerate(worlds):
        orbit = orbit_fingerprint(w)
        by_candidates.setdefault(fingerprint(w, symmetry=True), set()).add(i)
        by_orbit.setdefault(orbit, set()).add(i)
        plain_in_orbit.setdefault(orbit, set()).add(fingerprint(w))
        tried, group = tried + len(symmetries(w)), group + len(every_renaming(w))
    assert sorted(map(sorted, by_candidates.values())) == sorted(map(sorted, by_orbit.values()))
    assert sum(len(p) > 1 for p in plain_in_orbit.values()) > 10, "too few states equal only up to a renaming"
    assert tried < group / 2, (tried, group)


def test_a_copied_state_is_independent():
    world = build_world(CheckBounds(requests=1))
    copy = pickle.loads(pickle.dumps(world))
    apply(copy, enabled(copy)[0])
    assert copy.cluster.rooms == 1 and world.cluster.rooms == 0 and copy.cluster.decode.reqs and not world.cluster.decode.reqs


@pytest.mark.parametrize("field,value", [("requests", 0), ("faults", -1), ("prefill_ranks", 0), ("pages", 0),
                                         ("abort_sends", 0), ("channel_capacity", 0), ("timeout_s", 0)])
def test_bad_bounds_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        CheckBounds(**{field: value})


def test_unknown_guard_is_rejected():
    with pytest.raises(ValueError, match="guard: expected one of"):
        CheckBounds(guards_off=("no-such-guard",))


def test_counterexample_file_round_trip(tmp_path):
    result = run_check(teeth_bounds("legacy"))
    save_counterexample(tmp_path / "ce.json", result)
    bounds, trace, violation = load_counterexample(tmp_path / "ce.json")
    assert bounds == teeth_bounds("legacy") and trace == result["counterexample"]["trace"]
    (tmp_path / "bad.json").write_text(json.dumps({"trace": []}))
    with pytest.raises(ValueError, match="expected a counterexample file with 'bounds'"):
        load_counterexample(tmp_path / "bad.json")


# a false suspicion (issue 28: the real pair's bootstrap link revokes a fenced live process) -------------------
LEASE_LOSS = dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0, polls=0, fault_kinds=("lease_loss",))


def test_a_live_rank_fenced_on_a_false_suspicion_is_safe_and_live():
    result = run_check(CheckBounds(**LEASE_LOSS))
    assert result["complete"] and result["violations"] == [] and result["terminal_states"] > 0


def test_a_false_suspicion_without_the_fence_frees_pages_a_live_writer_still_writes():
    result = run_check(CheckBounds(**LEASE_LOSS, guards_off=("fence-refuses-writes",)))
    assert result["violations"] == ["freed_while_writing"]
    trace = result["counterexample"]["trace"]
    assert any("lease expires while it runs" in step for step in trace)
    assert not any("crashes" in step or "dies" in step for step in trace)  # the writer never died


# a cut control link (decode's unreachable fence): the rank holds its lease, decode hears nothing from it ---------
UNREACHABLE = dict(prefill_ranks=1, requests=1, faults=1, cancels=0, retries=0, polls=0, fault_kinds=("partition",),
                   fence_unreachable=True)


@pytest.mark.slow
def test_fencing_an_unreachable_rank_is_safe_and_live():
    result = run_check(CheckBounds(**UNREACHABLE))
    assert result["complete"] and result["violations"] == [] and result["terminal_states"] > 0
    without = run_check(CheckBounds(**{**UNREACHABLE, "fence_unreachable": False}))
    assert without["complete"] and without["states"] < result["states"]  # the policy's timer adds interleavings


def test_an_unreachable_fence_that_does_not_refuse_writes_frees_pages_a_live_writer_still_writes():
    result = run_check(CheckBounds(**UNREACHABLE, guards_off=("fence-refuses-writes",)))
    assert result["violations"] == ["freed_while_writing"]
    trace = result["counterexample"]["trace"]
    assert any("unreachable-fence timer" in step for step in trace)
    assert not any("crashes" in step or "dies" in step or "lease expires" in step for step in trace)
