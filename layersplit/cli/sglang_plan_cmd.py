"""``layersplit sglang-plan --sglang-args "<prefill worker flags>"``: what the SGLang plug-in will allocate,
what it falls back for (or refuses), and its KV capacity next to upstream's, before a server starts.
The flags go through SGLang's own parsing and resolution (:mod:`layersplit.sglang_plugin.operator_view`).

A capacity planner: it runs where the operator is (a laptop without a GPU too), resolving the flags as on
the prefill worker: a CUDA device (``--device cuda`` unless the flags name one) of the generation ``--sm``
names, else ``--hardware``'s, else the GPU here. Needs SGLang (``pip install '.[sglang]'``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex

from layersplit.cli import options

NEEDS = "needs SGLang: pip install '.[sglang]' (from a checkout) or pip install 'layersplit[sglang]'"


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("sglang-plan",
                       help=f"the SGLang plug-in's start-up plan for a prefill worker's flags ({NEEDS})",
                       description="What the SGLang plug-in will allocate, fall back for or refuse on a prefill worker "
                                   "with these flags, resolved by SGLang's own parsing as on that worker's GPU (runs "
                                   f"without a GPU here). It {NEEDS}.")
    p.add_argument("--sglang-args", required=True,
                   help="the prefill worker's sglang.launch_server flags, quoted as one string (needs the model's "
                        "config.json at --model-path)")
    p.add_argument("--sm", default=None, help="resolve as on this GPU generation, e.g. 90 (H200) or 100 (B200); "
                                              "default: --hardware's, else the GPU here")
    p.add_argument("--model", type=options.name_or_path, default=None,
                   help="model config (configs/models) for the capacity rows, e.g. glm-5")
    p.add_argument("--hardware", type=options.name_or_path, default=None,
                   help="hardware config (configs/hardware) for the capacity rows and the default --sm")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _sm(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    if not text.isdigit() or len(text) < 2:
        raise ValueError(f"--sm: expected a compute capability like 90 or 100, got {text!r}")
    return int(text[:-1]), int(text[-1])


def _default_sm(hardware: str | None) -> tuple[int, int] | None:
    """Without ``--sm``: ``--hardware``'s generation (``sm_major``), else None (the GPU here); no GPU and no
    hardware is refused here, before SGLang asks CUDA for a capability it does not have."""
    if hardware is not None:
        from layersplit.plan.config import load_hardware

        try:
            major = load_hardware(hardware).sm_major
        except ValueError as exc:
            raise ValueError(f"--hardware: {exc}") from None
        if major == 0:
            raise ValueError(f"--hardware: {hardware!r} has no CUDA device (sm_major 0); expected a GPU's "
                             "hardware config, or --sm")
        return major, 0
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--sm: no GPU here to resolve as; expected --sm (e.g. 90 for H200, 100 for B200) or "
                         "--hardware (e.g. h200)")
    return None


def _worker_flags(text: str) -> list[str]:
    """The worker's flags, resolved as on its CUDA device: ``--device cuda`` added unless they name one (SGLang's
    default asks this machine for an accelerator; a planner on a laptop has none, and the worker's is CUDA)."""
    try:
        flags = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--sglang-args: expected flags quoted as on a command line, got {exc}") from None
    if not flags:
        raise ValueError("--sglang-args: expected the prefill worker's flags, got none")
    named = any(f == "--device" or f.startswith("--device=") for f in flags)
    return flags if named else [*flags, "--device", "cuda"]


def run(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.hardware is None):
        raise ValueError("--model/--hardware: expected both (for the capacity rows) or neither, got one")
    flags = _worker_flags(args.sglang_args)
    sm = _sm(args.sm) if args.sm is not None else _default_sm(args.hardware)
    if importlib.util.find_spec("sglang") is None:
        raise ValueError(f"sglang-plan {NEEDS}; got no sglang module here")
    from layersplit.sglang_plugin import operator_view

    view = operator_view.resolve(flags, sm=sm)
    cap = operator_view.capacity(view, args.model, args.hardware) if args.model and not view["refused"] else None
    if args.json:
        out = {k: v for k, v in view.items() if k != "plan"}
        print(json.dumps({**out, "capacity_model": cap}, indent=2))
        return 2 if view["refused"] else 0
    print(f"DSA prefill kernel        {view['dsa_prefill_backend']}  (KV {view['kv_dtype']}, page {view['page_size']}, "
          f"CP {view['cp']}, context {view['context_len']:,})")
    if view["refused"]:
        print(f"REFUSED at start-up       {view['refused']}")
        return 2
    print(f"landing                   {view['landing']}"
          + ("  (non-owned layers read from the staging slots)" if view["landing"] == "batch"
             else "  (upstream's pool-sized landing layer kept, counted in the KV budget)"))
    for reason in view["fallbacks"] or ["none: every forward reads through the remapped page tables"]:
        print(f"  fallback                {reason}")
    print(f"allocated at start-up     2 staging slots x {view['slot_tokens']:,} tokens = {view['staging_bytes'] / 2**30:.3f} GiB"
          + (", remap table 1 B a token" if view["landing"] == "batch" else "")
          + "; charged to SGLang's KV budget, nothing allocated later")
    if cap:
        for dtype, row in cap.items():
            print(f"tokens per rank, {dtype:<4} (model)  plug-in {row['plugin']:,}  upstream split {row['upstream']:,}  "
                  f"redundant CP {row['redundant']:,}  (budget {row['budget_bytes'] / 2**30:.2f} GiB)")
    return 0
