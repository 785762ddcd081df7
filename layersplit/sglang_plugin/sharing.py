"""Prefix pages shared by requests of one batch: found on the host, in SGLang's radix tree.

Requests that share a prefix share its radix-tree nodes, hence the same KV pages: their
``req_to_token`` rows hold the same page ids for the tokens on the common path (the common prefix
of their device paths root -> ``req.last_node``). This module measures, for each request of a batch
in batch order, how many leading prefix tokens an earlier request of the batch already covers
(:func:`shared_prefix_tokens`; only host data: node key lengths and parents, no device read).

Two hooks use it:

* AFTER ``ScheduleBatch.prepare_for_extend`` (the scheduler, once the batch's rows are written):
  records ``rid -> (prefix_len, shared tokens)``; the metadata hook (:mod:`.batch`) reads it by the
  forward batch's ``rids`` and gathers each request's pages from its first unshared column, so every
  prefix page is staged and broadcast once per batch;
* AROUND ``PrefillAdder.add_one_req`` (admission): a request joins the batch only while the batch's
  de-duplicated pages (shared pages once, each request's own pages, one partial page each) fit one
  staging slot; otherwise it waits for the next batch (``AddReqResult.OTHER``, SGLang's "stop adding").
  A request alone always fits: a slot holds a whole context (:func:`.startup.slot_pages`).
"""

from __future__ import annotations

from collections import OrderedDict

_recorded: OrderedDict = OrderedDict()  # rid -> (prefix_len, shared tokens); bounded
_RECORD_LIMIT = 8192


def _path(node) -> list:
    """Nodes root-excluded from the root down to ``node`` with the token depth at each node's end."""
    chain = []
    while node is not None and getattr(node, "parent", None) is not None:
        chain.append(node)
        node = node.parent
    depth, out = 0, []
    for n in reversed(chain):
        depth += len(n.key) if n.key is not None else 0
        out.append((n, depth))
    return out


def shared_prefix_tokens(reqs, page_size: int) -> list[int]:
    """For each request (batch order): leading prefix tokens an earlier request of the batch covers,
    in whole pages, at most its own prefix."""
    seen: dict[int, int] = {}  # id(node) -> token depth at its end, over earlier requests' paths
    shared = []
    for req in reqs:
        path = _path(getattr(req, "last_node", None))
        covered = 0
        for node, depth in reversed(path):  # deepest node an earlier request also holds
            if id(node) in seen:
                covered = seen[id(node)]
                break
        prefix = int(getattr(req, "prefix_len", 0) or 0)
        shared.append(min(covered, prefix) // page_size * page_size)
        for node, depth in path:  # what this request's row covers of each node: its prefix at most
            seen[id(node)] = max(seen.get(id(node), 0), min(depth, prefix))
    return shared


def batch_pages_needed(reqs, page_size: int) -> int:
    """Upper bound of the distinct pages a batch of ``reqs`` reads in one forward: each request's
    whole fill (prefix, host hits, new tokens) in pages plus a partial page, less its shared pages."""
    shared = shared_prefix_tokens(reqs, page_size)
    total = 0
    for req, s in zip(reqs, shared):
        tokens = len(getattr(req, "full_untruncated_fill_ids", ()) or ()) or int(getattr(req, "extend_end", 0) or 0)
        total += -(-tokens // page_size) + 1 - s // page_size
    return total


def record(reqs, page_size: int) -> None:
    for req, s in zip(reqs, shared_prefix_tokens(reqs, page_size)):
        _recorded[req.rid] = (int(req.prefix_len), s)
        _recorded.move_to_end(req.rid)
    while len(_recorded) > _RECORD_LIMIT:
        _recorded.popitem(last=False)


def lookup(rids, prefix_lens: list[int]) -> list[int]:
    """Shared tokens per request of a forward (0 where nothing matching was recorded)."""
    if rids is None:
        return [0] * len(prefix_lens)
    out = []
    for rid, prefix in zip(rids, prefix_lens):
        got = _recorded.get(rid)
        out.append(got[1] if got is not None and got[0] == prefix else 0)
    return out


def forget() -> None:
    _recorded.clear()


# hooks ------------------------------------------------------------------------------------------
def after_prepare_for_extend(result, batch, *args, **kwargs):
    """AFTER hook on ``ScheduleBatch.prepare_for_extend(self)``."""
    from layersplit.sglang_plugin import startup

    plan = startup.current()
    if plan is not None and plan.landing == "batch":
        record(batch.reqs, plan.page_size)
    return None


def around_add_one_req(original, adder, req, *args, **kwargs):
    """AROUND hook on ``PrefillAdder.add_one_req(self, req, has_chunked_req, truncation_align_size)``:
    defer ``req`` while the batch would outgrow a staging slot; else SGLang's admission as is."""
    from layersplit.sglang_plugin import startup

    plan = startup.current()
    admitted = list(getattr(adder, "can_run_list", ()) or ())
    if plan is not None and plan.landing == "batch" and admitted:
        if batch_pages_needed(admitted + [req], plan.page_size) > plan.slot_pages:
            from sglang.srt.managers.schedule_policy import AddReqResult

            from layersplit.sglang_plugin import metrics

            metrics.shared().add("deferred", "slot", 1)
            return AddReqResult.OTHER
    return original(adder, req, *args, **kwargs)


PREPARE_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
PREPARE_SIGNATURE = "(self)"
ADMISSION_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
ADMISSION_SIGNATURE = "(self, req: 'Req', has_chunked_req: 'bool', truncation_align_size: 'Optional[int]')"
