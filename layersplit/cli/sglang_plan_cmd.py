"""``layersplit sglang-plan --sglang-args "<prefill worker flags>"``: what the SGLang plug-in will allocate,
what it falls back for (or refuses), and its KV capacity next to upstream's, before a server starts.
The flags go through SGLang's own parsing and resolution (:mod:`layersplit.sglang_plugin.operator_view`)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("sglang-plan", help="the SGLang plug-in's start-up plan for a prefill worker's flags")
    p.add_argument("--sglang-args", required=True,
                   help="the prefill worker's sglang.launch_server flags, quoted as one string (needs the model's "
                        "config.json at --model-path)")
    p.add_argument("--sm", default=None, help="resolve as on this GPU generation, e.g. 90 (H200) or 100 (B200); "
                                              "default: the GPU here")
    p.add_argument("--model", default=None, help="model config (configs/models) for the capacity rows, e.g. glm-5")
    p.add_argument("--hardware", default=None, help="hardware config (configs/hardware) for the capacity rows")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _sm(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    if not text.isdigit() or len(text) < 2:
        raise ValueError(f"--sm: expected a compute capability like 90 or 100, got {text!r}")
    return int(text[:-1]), int(text[-1])


def run(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.hardware is None):
        raise ValueError("--model/--hardware: expected both (for the capacity rows) or neither, got one")
    from layersplit.sglang_plugin import operator_view

    view = operator_view.resolve(args.sglang_args, sm=_sm(args.sm))
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
