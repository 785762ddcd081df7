"""GPU check section ``stream_sanitizer``: the CP engine and the HiCache stress under a stream
sanitizer, each clean with every edge and each reported with an edge removed (the teeth).

* ``cuda`` mode: a child process started with ``TORCH_CUDA_SANITIZER=1`` (PyTorch's CUDA sanitizer,
  CSAN: it raises at the first kernel that touches a tensor without an ordering to the kernel that
  last wrote or read it on another stream). CSAN sees only dispatcher ops: our Triton and vendor
  kernels are registered custom ops whose schemas name what they write (``dsa_kernels.custom_ops``),
  so the indexer's and sparse attention's reads are visible to it. The child runs
  1. the HiCache stress on CUDA streams with every wait (no stalls), then with the reuse fence and
     with the indexer wait removed;
  2. the CP engine with **2 ranks over gloo on this one GPU** (CUDA tensors): the comm streams'
     collectives against the compute stream, which a single-rank run never exercises, checked
     against the single-rank reference within the device's measured tolerance;
  3. the engine with each stream edge removed (``FaultInjection.unsafe_skip_edges``): the comm stream's
     wait for compute; a scratch slot's release (with the issue-time wait, which also orders it); the
     host-tier reload's wait for the poison fill. Each must be reported, or the check proves nothing.
  CSAN would stop a run at its first hazard, so one removed edge could hide another: the child records
  every hazard instead (:mod:`hicache.sanitizer.csan`), and an engine tooth counts as reported only when a
  hazard names the ops its missing edge leaves unordered. The reload path has its own clean run.
* ``cpu-dry-run`` mode: the same runs under this project's emulated-runtime sanitizer
  (``LAYERSPLIT_SANITIZE=1``, :mod:`hicache.sanitizer`), in this process.

The child is started in a process group of its own (:mod:`.children`): the watchdog ends it and its
ranks. Run as a module (``python -m layersplit.gpu_check.sanitize``) it is the child: one JSON object
on stdout.
"""

from __future__ import annotations

import json
import os
import sys

import torch

STRESS_TEETH = ("fence", "indexer")  # waits of the HiCache load the stress drops, one run each
ENGINE_TEETH = {  # name: (edges removed, words one reported hazard must name, prefixes reloaded from host)
    "compute_wait": (frozenset({"compute_wait"}), ("allgather",), False),
    # the issue-time wait also orders a slot's refill after its reader: both removed, the slot's own
    # hazard (the broadcast into it against sparse attention reading it) must be among those reported
    "slot_release": (frozenset({"slot_release", "compute_wait"}), ("broadcast_", "sparse_mla_prefill"), False),
    "poison_fence": (frozenset({"poison_fence"}), ("fill_pages",), True),
}


def _scenario(context: int, unsafe: frozenset[str] = frozenset(), from_host: bool = False):
    from layersplit.engine.engine import EngineConfig, FaultInjection
    from layersplit.engine.launcher import Scenario
    from layersplit.engine.requests import synthetic_requests
    from layersplit.plan.config import load_model

    model = load_model("tiny")
    cfg = EngineConfig(mode="layersplit", cp=2, pool_pages=-(-context // 64), max_batch_tokens=context,
                       max_requests=1, faults=FaultInjection(unsafe_skip_edges=unsafe))
    reqs = synthetic_requests(1, context, 0.9, model.vocab_size, 0, from_host=from_host)
    return model, Scenario("sanitized" + ("-unsafe" if unsafe else ""), reqs, cfg)


def _engine(context: int, unsafe: frozenset[str], timeout_s: float, tol: float, from_host: bool = False) -> dict:
    """cp=2 under whatever sanitizer the environment enables; a sanitizer error ends the run."""
    from layersplit.engine.launcher import cp_backend, run_cp, run_reference
    from layersplit.gpu_check.agreement import rel_deviation

    model, sc = _scenario(context, unsafe, from_host)
    try:
        res = run_cp(model, [sc], 2, timeout_s=timeout_s)[0]
    except RuntimeError as exc:  # CSAN raises inside a rank: the launcher reports its traceback
        text = str(exc)
        found = any(mark in text for mark in ("CUDASanitizerErrors", "CSAN detected", "unordered with"))
        return {"hazards": 1 if found else None, "error": text[-1500:], "backend": cp_backend(2)}
    rel = rel_deviation(res.hidden, run_reference(model, sc).hidden)
    hazards = sorted({h for r in res.ranks for h in (r.hazards or [])})
    return {"hazards": None if res.ranks[0].hazards is None else len(hazards), "hazard_list": hazards,
            "max_rel_deviation": rel, "tol": tol, "backend": cp_backend(2)}


def _stress(loads: int, on_cuda: bool, unsafe: frozenset[str] = frozenset()) -> dict:
    from hicache.stress import StressConfig, run_stress
    from layersplit.engine.cp_pool import cache_spec
    from layersplit.plan.config import load_model

    model = load_model("tiny")
    # CSAN tracks a buffer by its pointer: the loads also follow the previous forward (StressConfig)
    cfg = StressConfig(layer_loads=loads, runtime="cuda" if on_cuda else "emulated", sanitize=not on_cuda,
                       max_delay_s=0.0, max_forward_delay_s=0.0, index_heads=model.index_n_heads,
                       attn_heads=model.num_heads, topk=model.index_topk, unsafe_skip=unsafe,
                       fence_previous_forward=on_cuda)
    try:
        r = run_stress(cache_spec(model), cfg)
    except Exception as exc:  # noqa: BLE001 - CSAN raises CUDASanitizerErrors at the hazard
        return {"hazards": 1, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    return {"hazards": r.sanitizer_hazards or 0, "hazard_list": r.sanitizer_hazard_list,
            "corrupted_outputs": r.corrupted_outputs, "outputs_checked": r.outputs_checked}


def run_checks(context: int, loads: int, timeout_s: float, tol: float) -> dict:
    """Every clean run and every tooth in this process (CSAN when ``TORCH_CUDA_SANITIZER=1`` set it up at
    import; on the CPU the emulated-runtime sanitizer, also in the rank processes)."""
    on_cuda = torch.cuda.is_available()
    key, value = ("LAYERSPLIT_CP_BACKEND", "gloo") if on_cuda else ("LAYERSPLIT_SANITIZE", "1")
    previous = os.environ.get(key)
    os.environ[key] = value  # set for these runs only: every process started later inherits it
    try:
        out = {"sanitizer": "torch CUDA sanitizer (CSAN, every hazard recorded)" if on_cuda
               else "hicache.sanitizer (emulated streams)",
               "stress": _stress(loads, on_cuda), "engine_cp2": _engine(context, frozenset(), timeout_s, tol),
               # the reload path's clean control: what its tooth reports is the poison fence's alone
               "engine_cp2_host": _engine(context, frozenset(), timeout_s, tol, from_host=True),
               "stress_teeth": {w: _stress(loads // 4, on_cuda, frozenset({w})) for w in STRESS_TEETH},
               "engine_teeth": {name: _engine(context, edges, timeout_s, tol, from_host=host)
                                for name, (edges, _, host) in ENGINE_TEETH.items()}}
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
    return _trimmed(out | verdict(out))


def brief(hazard: str) -> str:
    """A hazard in a few lines: CSAN's text carries long stack traces, so only its data pointer and
    both kernels (schema and access); the emulated sanitizer's lines as they are (at most 2,000 chars)."""
    if "CSAN detected" not in hazard:
        return hazard[:2000]
    lines = hazard.splitlines()
    keep = [line for line in lines if "data race" in line]
    for i, line in enumerate(lines):
        if line.endswith("during kernel:"):
            keep += lines[i:i + 3]
    return "\n".join(keep)


def _trimmed(out: dict) -> dict:
    """The report keeps each run's first 3 hazards, in brief (the verdict has read them whole)."""
    runs = [out["stress"], out["engine_cp2"], out["engine_cp2_host"], *out["stress_teeth"].values(),
            *out["engine_teeth"].values()]
    for run in runs:
        run["hazard_list"] = [brief(h) for h in run.get("hazard_list", [])[:3]]
    return out


def _names(run: dict, words: tuple[str, ...]) -> bool:
    """One hazard of ``run`` names every word (the ops on both sides; a raised CSAN error: its text)."""
    texts = run.get("hazard_list") or [run.get("error", "")]
    return any(all(w in text for w in words) for text in texts)


def verdict(out: dict) -> dict:
    """Clean runs clean and within the tolerance; every tooth reported (the engine's by the ops the
    missing edge leaves unordered). With the clean runs at 0, a stress tooth's hazards are its own."""
    teeth = {f"stress:{w}": bool(r["hazards"]) for w, r in out["stress_teeth"].items()}
    teeth |= {f"engine:{n}": bool(r["hazards"]) and _names(r, ENGINE_TEETH[n][1]) for n, r in out["engine_teeth"].items()}
    engines = (out["engine_cp2"], out["engine_cp2_host"])
    clean = out["stress"]["hazards"] == 0 and all(
        e["hazards"] == 0 and e.get("max_rel_deviation", float("inf")) <= e.get("tol", 0.0) for e in engines)
    return {"teeth_reported": teeth, "clean": clean, "passed": clean and all(teeth.values())}


def section(on_cuda: bool, context: int, loads: int, timeout_s: float, tol: float) -> dict:
    """CUDA: the checks in a child under ``TORCH_CUDA_SANITIZER=1`` (CSAN must be on before CUDA
    starts); CPU: in this process under the emulated-runtime sanitizer."""
    from layersplit.gpu_check import children

    if not on_cuda:
        result = run_checks(context, loads, timeout_s, tol)
    else:
        env = os.environ | {"TORCH_CUDA_SANITIZER": "1"}
        cmd = [sys.executable, "-m", "layersplit.gpu_check.sanitize", str(context), str(loads), str(timeout_s), str(tol)]
        proc = children.run(cmd, env, timeout_s * 8 + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"sanitized child exited {proc.returncode}: {proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    e, h, s = result["engine_cp2"], result["engine_cp2_host"], result["stress"]
    missed = [name for name, hit in result["teeth_reported"].items() if not hit]
    result["summary"] = (f"{result['sanitizer']}: stress {s['hazards']} hazards; CP engine cp=2 ({e['backend']}) "
                         f"{e['hazards']} hazards, with a host-tier reload {h['hazards']}; "
                         f"{len(result['teeth_reported']) - len(missed)} of "
                         f"{len(result['teeth_reported'])} removed edges reported"
                         + (f" (missed: {', '.join(missed)})" if missed else ""))
    return result


if __name__ == "__main__":
    context_arg, loads_arg, timeout_arg, tol_arg = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    print(json.dumps(run_checks(context_arg, loads_arg, timeout_arg, tol_arg)))
