"""Input builders and comparison helpers for the kernel tests."""

from __future__ import annotations

import contextlib

import torch

from dsa_kernels.dispatch import resolve


def op(name: str, backend: str, device: torch.device):
    return resolve(name, device, backend)[1]


def fp8_exact_rows(n: int, d: int, gen: torch.Generator, tile: int | None = None) -> torch.Tensor:
    """Rows whose per-``tile`` quantization is exact: e4m3 values times a power of 2, with +-448
    (the amax) in every tile, so ``x / scale`` is representable and any backend's cast is exact."""
    tile = tile or d
    vals = torch.randn(n, d, generator=gen).to(torch.float8_e4m3fn).float()
    vals.view(n, d // tile, tile)[:, :, 0] = 448.0 * torch.sign(torch.randn(n, d // tile, 1, generator=gen)).squeeze(-1)
    exps = torch.randint(-10, 6, (n, d // tile), generator=gen).float()
    return (vals.view(n, d // tile, tile) * torch.exp2(exps)[..., None]).view(n, d)


def distinct_slots(n: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_pages * 64, generator=gen)[:n]


def assert_same_inf(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """NaN and infinity positions first: none may be NaN; infinities must match exactly."""
    assert not torch.isnan(actual).any(), "NaN in output"
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "masked (-inf) positions differ"
    assert torch.equal(actual[torch.isinf(actual)], expected[torch.isinf(expected)]), "inf signs differ"


def assert_topk_equivalent(got: torch.Tensor, want: torch.Tensor, ref_scores: torch.Tensor, atol: float) -> None:
    """Top-k results agree as index sets, up to entries whose reference score is within ``atol``
    of the row's k-th score (a near-tie any fp32 rounding may flip). -1 padding counts must match."""
    assert torch.equal((got < 0).sum(1), (want < 0).sum(1)), "different number of -1 pads"
    for t in range(got.shape[0]):
        a, b = set(got[t][got[t] >= 0].tolist()), set(want[t][want[t] >= 0].tolist())
        if a == b:
            continue
        kth = ref_scores[t, list(b)].min()
        for s in a ^ b:
            assert abs(float(ref_scores[t, s] - kth)) <= atol, f"row {t}: index {s} differs and is not a near-tie"


HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "masked_select", "item")
HOST_READ_METHODS = ("tolist", "item", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Count what would make the host wait for the device: ops whose output size or value the host
    must read (``.item()``, ``nonzero``, ``unique``, boolean-mask selection), and the tensor methods
    that read data without dispatching anything on CPU (``tolist``, ``numpy``, ``int(t)``, ...).
    Yields a list of the names seen, in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in HOST_READ_OPS:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    originals = {m: getattr(torch.Tensor, m) for m in HOST_READ_METHODS}

    def counted(method):
        def read(self, *args, **kwargs):
            seen.append(method)
            return originals[method](self, *args, **kwargs)
        return read

    try:
        for m in HOST_READ_METHODS:
            setattr(torch.Tensor, m, counted(m))
        with Mode():
            yield seen
    finally:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, fn)
