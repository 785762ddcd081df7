"""The checker's world copies (tools.pd_check.snapshot): the frozen configuration is shared, not copied,
and only what nothing can change is shared."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, replace

import pytest

from tools.pd_check.bounds import CheckBounds
from tools.pd_check.snapshot import Snapshots, _immutable
from tools.pd_check.state import canonical
from tools.pd_check.world import OWED, apply, build_world, enabled


def _mid_search_world(steps: int = 12):
    world, rng = build_world(CheckBounds()), random.Random(3)
    for _ in range(steps):
        owed = [a for a in enabled(world) if a[0] in OWED]
        apply(world, rng.choice(owed))
    return world


def test_a_copy_is_the_same_state_and_shares_only_the_configuration():
    world = _mid_search_world()
    with Snapshots(world) as snap:
        blob = snap.dumps(world)
        copy = snap.loads(blob)
        assert snap.shared_count >= 5  # bounds, stress config, decode / prefill configs, topology, ...
    assert canonical(copy) == canonical(world)
    assert copy.cluster.cfg is world.cluster.cfg and copy.bounds is world.bounds
    assert copy.cluster.decode.cfg is world.cluster.decode.cfg
    assert copy.cluster.decode is not world.cluster.decode and copy.cluster.decode.reqs is not world.cluster.decode.reqs
    assert len(blob) < len(pickle.dumps(world, pickle.HIGHEST_PROTOCOL))


def test_a_step_on_a_copy_leaves_the_original_alone():
    world = _mid_search_world()
    before = canonical(world)
    with Snapshots(world) as snap:
        copy = snap.loads(snap.dumps(world))
        apply(copy, next(a for a in enabled(copy) if a[0] in OWED))
    assert canonical(world) == before != canonical(copy)


def test_an_instance_built_later_is_copied_by_value():
    world = _mid_search_world(0)
    with Snapshots(world) as snap:
        later = replace(world.cluster.cfg, seed=7)  # e.g. a config a restart builds: not registered
        copy = snap.loads(snap.dumps(later))
    assert copy == later and copy is not later


def test_a_blob_is_not_loaded_once_its_shared_instances_are_forgotten():
    world = _mid_search_world(0)
    with Snapshots(world) as snap:
        blob = snap.dumps(world)
    with pytest.raises(KeyError):
        Snapshots.loads(blob)


@dataclass(frozen=True)
class _WithList:
    values: list


@dataclass
class _Thawed:
    x: int = 1


@dataclass(frozen=True)
class _Nested:
    inner: object = None


@pytest.mark.parametrize("value, shared", [
    (_Thawed(), False), (_WithList([1]), False), (_Nested(_Thawed()), False), (_Nested((1, "a", None)), True),
    (_Nested(_Nested(frozenset({2.5}))), True), (_Nested({"a": 1}), False),
], ids=["not-frozen", "list-field", "mutable-inside", "tuple", "nested-frozenset", "dict-field"])
def test_only_frozen_all_immutable_dataclasses_are_shared(value, shared):
    assert _immutable(value) is shared
