"""The stream sanitizer never says "clean" about a run it cannot see.

It models the emulated runtime only: CUDA streams and events never feed it, so under a CUDA runtime
it would attribute every op to the host and report 0 hazards. With the sanitizer on, making a CUDA
runtime (or giving an existing one's streams work) raises one line before any work starts. No GPU
here: the stand-in is ``torch.cuda.is_available`` patched to True, which is all that ``auto`` and
``"cuda"`` runtime choice read before the refusal.
"""

from __future__ import annotations

import pytest
import torch

from hicache import sanitizer
from hicache.runtime import streams
from hicache.paged_buffers import DSACacheSpec
from hicache.runtime.streams import BLIND_SANITIZER, CudaEvent, CudaStream, get_runtime

SPEC = DSACacheSpec(num_layers=2, kv_lora_rank=128, rope_dim=16, index_head_dim=32, indexer_layers=(0,))
REFUSAL = "LAYERSPLIT_SANITIZE=1: the stream sanitizer models the emulated runtime only; got a CUDA runtime"


@pytest.fixture
def cuda_stand_in(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA touched before the refusal"))


def test_the_refusal_is_one_line_naming_the_way_out():
    assert BLIND_SANITIZER.startswith(REFUSAL) and "\n" not in BLIND_SANITIZER
    assert "TORCH_CUDA_SANITIZER=1" in BLIND_SANITIZER and "emulated" in BLIND_SANITIZER


@pytest.mark.parametrize("kind", ["auto", "cuda"])
def test_a_cuda_runtime_under_the_sanitizer_is_refused(cuda_stand_in, kind):
    with sanitizer.sanitized() as san, pytest.raises(ValueError, match=REFUSAL):
        get_runtime(kind)
    assert san.ops_checked == 0


def test_without_the_sanitizer_the_cuda_choice_is_untouched(cuda_stand_in, monkeypatch):
    made = []
    monkeypatch.setattr(streams.CudaRuntime, "__init__", lambda self, device=None: made.append(device))
    assert get_runtime("auto").kind == "cuda" and made == [None]


def test_an_existing_cuda_runtime_gets_no_work_once_the_sanitizer_is_on():
    """A runtime made before the sanitizer was enabled: its streams refuse work, its events records."""
    stream, event = object.__new__(CudaStream), object.__new__(CudaEvent)  # no GPU: never reaches CUDA
    ran = []
    with sanitizer.sanitized():
        with pytest.raises(ValueError, match=REFUSAL):
            stream.submit(lambda: ran.append(1))
        with pytest.raises(ValueError, match=REFUSAL):
            event.record(stream)
    assert ran == []


def test_the_sanitized_stress_refuses_before_any_work(cuda_stand_in, monkeypatch):
    """``layersplit stress hicache`` with ``LAYERSPLIT_SANITIZE=1`` on a GPU (``sanitize=True``)."""
    from hicache import stress

    monkeypatch.setattr(stress, "DSADevicePool", lambda *a, **k: pytest.fail("a pool was allocated"))
    with pytest.raises(ValueError, match=REFUSAL):
        stress.run_stress(SPEC, stress.StressConfig(layer_loads=8, runtime="auto", sanitize=True))
    assert sanitizer.current() is None
