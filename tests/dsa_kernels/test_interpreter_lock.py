"""Interpreted Triton launches from several threads (emulated streams) are serialized by dispatch.

The Triton interpreter keeps its grid (and its patched ``tl`` builtins) in process-global state.
``test_concurrent_launches_equal_reference`` runs mixed ops from four threads at once and compares
each result with the torch reference. ``test_grid_collision_*`` makes the collision deterministic:
two launches with transposed grids, ``(2, 1)`` and ``(1, 3)``, meet after both have set the grid
(a rendezvous wrapped around the interpreter's ``set_grid_dim``). Unlocked, whichever grid was set
last is too small on one axis for the other launch, so that launch indexes past it and raises;
with the lock the second launch cannot start until the first is done (the rendezvous times out).
"""

from __future__ import annotations

import threading

import pytest
import torch

from dsa_kernels import dispatch, layout
from lsconfig import envs
from tests.dsa_kernels.helpers import distinct_slots, op

pytestmark = pytest.mark.skipif(not envs.triton_interpret(), reason="the lock exists under TRITON_INTERPRET=1 only")
CPU = torch.device("cpu")


def run_threads(jobs) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(job):
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - collected and asserted on by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a launch thread hung"
    return errors


def index_job(seed: int, results: dict):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(10 + seed, 64, generator=gen).to(torch.bfloat16)
    slots = distinct_slots(keys.shape[0], 3, gen)

    def job():
        cache = torch.zeros(3, layout.index_page_bytes(64), dtype=torch.uint8)
        for _ in range(2):
            op("quantize_index_keys", "triton", CPU)(keys, cache, slots)
        results[("index", seed)] = cache

    want = torch.zeros(3, layout.index_page_bytes(64), dtype=torch.uint8)
    op("quantize_index_keys", "torch", CPU)(keys, want, slots)
    return job, ("index", seed), want


def pages_job(seed: int, results: dict):
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (9, 3000 + 64 * seed), dtype=torch.uint8, generator=gen)
    ids = torch.randperm(9, generator=gen)[:5 + seed]

    def job():
        for _ in range(3):
            out = op("gather_pages", "triton", CPU)(pages, ids)
        results[("pages", seed)] = out

    return job, ("pages", seed), op("gather_pages", "torch", CPU)(pages, ids)


@pytest.mark.parametrize("threads", [4])
def test_concurrent_launches_equal_reference(threads):
    results: dict = {}
    made = [(index_job if i % 2 else pages_job)(i, results) for i in range(threads)]
    errors = run_threads([m[0] for m in made])
    assert not errors, f"interpreted launches collided: {errors[0]!r}"
    for _, key, want in made:
        assert torch.equal(results[key], want), f"{key}: result differs from the torch reference"


def rendezvous_on_grid(monkeypatch, parties: int, timeout_s: float) -> None:
    """Each launch, after setting the interpreter's grid, waits (at most ``timeout_s``) until
    ``parties`` launches have set theirs, then runs its programs."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    original = builder.set_grid_dim
    cond, arrived = threading.Condition(), [0]

    def set_grid_dim(nx, ny, nz):
        original(nx, ny, nz)
        with cond:
            arrived[0] += 1
            cond.notify_all()
            cond.wait_for(lambda: arrived[0] >= parties, timeout=timeout_s)

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)


def transposed_grid_launches() -> tuple[list, dict, dict]:
    """gather_pages over 2 pages of 256 words (grid (2, 1)) and over 1 page of 2112 words (grid (1, 3))."""
    gen = torch.Generator().manual_seed(0)
    wide_rows = torch.randint(0, 256, (4, 1024), dtype=torch.uint8, generator=gen)
    long_rows = torch.randint(0, 256, (3, 8448), dtype=torch.uint8, generator=gen)
    cases = {"grid-2x1": (wide_rows, torch.tensor([3, 1])), "grid-1x3": (long_rows, torch.tensor([2]))}
    results: dict = {}

    def launch(name):
        pages, ids = cases[name]
        results[name] = op("gather_pages", "triton", CPU)(pages, ids)

    wants = {name: op("gather_pages", "torch", CPU)(*args) for name, args in cases.items()}
    return [lambda n=n: launch(n) for n in cases], results, wants


def test_grid_collision_prevented_by_lock(monkeypatch):
    rendezvous_on_grid(monkeypatch, parties=2, timeout_s=0.5)
    jobs, results, wants = transposed_grid_launches()
    errors = run_threads(jobs)
    assert not errors, f"locked launches collided: {errors[0]!r}"
    assert all(torch.equal(results[n], wants[n]) for n in wants)


def test_grid_collision_without_lock_is_detected(monkeypatch):
    """Teeth: the same two launches with the lock switched off collide, every time."""
    monkeypatch.setattr(dispatch, "UNSAFE_UNLOCKED_INTERPRETER", True)
    rendezvous_on_grid(monkeypatch, parties=2, timeout_s=30.0)
    jobs, results, wants = transposed_grid_launches()
    errors = run_threads(jobs)
    wrong = [n for n in wants if n in results and not torch.equal(results[n], wants[n])]
    assert errors or wrong, "two unlocked interpreted launches did not collide"
    assert any("grid_dim" in repr(e) for e in errors), f"expected the interpreter's grid error, got {errors!r}"


def test_lock_only_under_the_interpreter(monkeypatch):
    """On a GPU (no interpreter) no lock: ``_wrap`` leaves the launch as it is (``resolve`` still puts
    the contract check and the custom op around it)."""
    from dsa_kernels.triton_ops import paged_copy

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch._wrap("triton", "gather_pages", paged_copy.gather_pages) is paged_copy.gather_pages
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch._wrap("triton", "gather_pages", paged_copy.gather_pages) is not paged_copy.gather_pages
