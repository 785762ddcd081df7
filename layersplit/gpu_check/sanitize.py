"""GPU check section ``stream_sanitizer``: the CP engine and the HiCache stress under a stream sanitizer.

* ``cuda`` mode: a child process started with ``TORCH_CUDA_SANITIZER=1`` (PyTorch's CUDA sanitizer,
  CSAN: it raises at the first kernel that touches a tensor without an ordering to the kernel that
  last wrote or read it on another stream) runs
  1. the HiCache stress on CUDA streams with every wait (no stalls);
  2. the CP engine with **2 ranks over gloo on this one GPU** (``LAYERSPLIT_CP_BACKEND=gloo``, CUDA
     tensors): the comm stream's collectives against the compute stream, which a single-rank run
     never exercises, checked against the single-rank reference;
  3. the same engine run with the comm stream's wait for compute removed: CSAN must report it
     (otherwise the check proves nothing).
* ``cpu-dry-run`` mode: the same three under this project's emulated-runtime sanitizer
  (``LAYERSPLIT_SANITIZE=1``, :mod:`hicache.sanitizer`), in this process.

Run as a module (``python -m layersplit.gpu_check.sanitize``) it is the child: one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def _scenario(context: int, unsafe: frozenset[str] = frozenset()):
    from layersplit.plan.config import load_model
    from layersplit.engine.engine import EngineConfig
    from layersplit.engine.launcher import Scenario
    from layersplit.engine.requests import synthetic_requests

    model = load_model("tiny")
    cfg = EngineConfig(mode="layersplit", cp=2, pool_pages=-(-context // 64), max_batch_tokens=context,
                       max_requests=1, unsafe_skip_edges=unsafe)
    return model, Scenario("sanitized" + ("-unsafe" if unsafe else ""), synthetic_requests(1, context, 0.9, model.vocab_size, 0), cfg)


def _engine(context: int, unsafe: frozenset[str], timeout_s: float) -> dict:
    """cp=2 under whatever sanitizer the environment enables; a sanitizer error ends the run."""
    from layersplit.engine.launcher import cp_backend, run_cp, run_reference

    model, sc = _scenario(context, unsafe)
    try:
        res = run_cp(model, [sc], 2, timeout_s=timeout_s)[0]
    except RuntimeError as exc:  # CSAN raises inside a rank: the launcher reports its traceback
        text = str(exc)
        found = "CUDASanitizerErrors" in text or "unsynchronized" in text.lower()
        return {"hazards": 1 if found else None, "error": text[-1500:], "backend": cp_backend()}
    ref = run_reference(model, sc)
    rel = float((res.hidden - ref.hidden).abs().max() / ref.hidden.abs().max())
    hazards = res.ranks[0].hazards
    return {"hazards": 0 if hazards is None else len({h for r in res.ranks for h in r.hazards}),
            "max_rel_deviation": rel, "backend": cp_backend()}


def _stress(loads: int, on_cuda: bool) -> dict:
    from hicache.stress import StressConfig, run_stress
    from layersplit.plan.config import cache_spec, load_model

    model = load_model("tiny")
    cfg = StressConfig(layer_loads=loads, runtime="cuda" if on_cuda else "emulated", sanitize=not on_cuda,
                       max_delay_s=0.0, max_forward_delay_s=0.0, index_heads=model.index_n_heads,
                       attn_heads=model.num_heads, topk=model.index_topk)
    try:
        r = run_stress(cache_spec(model), cfg)
    except Exception as exc:  # noqa: BLE001 - CSAN raises CUDASanitizerErrors at the hazard
        return {"hazards": 1, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    return {"hazards": r.sanitizer_hazards or 0, "corrupted_outputs": r.corrupted_outputs,
            "outputs_checked": r.outputs_checked}


def run_checks(context: int, loads: int, timeout_s: float) -> dict:
    """The three checks in this process (CSAN when ``TORCH_CUDA_SANITIZER=1`` set it up at import)."""
    on_cuda = torch.cuda.is_available()
    # two ranks on this one GPU (CUDA) / the emulated-runtime sanitizer in the rank processes (CPU);
    # set for these runs only: the variable is inherited by every process started later
    key, value = ("LAYERSPLIT_CP_BACKEND", "gloo") if on_cuda else ("LAYERSPLIT_SANITIZE", "1")
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        out = {"sanitizer": "torch CUDA sanitizer (CSAN)" if on_cuda else "hicache.sanitizer (emulated streams)",
               "stress": _stress(loads, on_cuda), "engine_cp2": _engine(context, frozenset(), timeout_s),
               "engine_cp2_without_compute_wait": _engine(context, frozenset({"compute_wait"}), timeout_s)}
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
    out["passed"] = (out["stress"]["hazards"] == 0 and out["engine_cp2"]["hazards"] == 0
                     and out["engine_cp2"].get("max_rel_deviation", 1.0) <= 1e-4
                     and bool(out["engine_cp2_without_compute_wait"]["hazards"]))
    return out


def section(on_cuda: bool, context: int, loads: int, timeout_s: float) -> dict:
    """CUDA: the checks in a child under ``TORCH_CUDA_SANITIZER=1`` (CSAN must be on before CUDA
    starts); CPU: in this process under the emulated-runtime sanitizer."""
    if not on_cuda:
        result = run_checks(context, loads, timeout_s)
    else:
        env = os.environ | {"TORCH_CUDA_SANITIZER": "1"}
        cmd = [sys.executable, "-m", "layersplit.gpu_check.sanitize", str(context), str(loads), str(timeout_s)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s * 3 + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"sanitized child exited {proc.returncode}: {proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    e, u, s = result["engine_cp2"], result["engine_cp2_without_compute_wait"], result["stress"]
    result["summary"] = (f"{result['sanitizer']}: stress {s['hazards']} hazards; CP engine cp=2 "
                         f"({e['backend']}) {e['hazards']} hazards; without the comm stream's wait for "
                         f"compute {u['hazards']} (must be > 0)")
    return result


if __name__ == "__main__":
    context_arg, loads_arg, timeout_arg = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    print(json.dumps(run_checks(context_arg, loads_arg, timeout_arg)))
