"""How much a clean run of random walks has left unseen: estimates over the classes of the states the walks
ended in (the fuzzing literature's species estimates, Böhme's STADS, applied to a walk's end state).

Each walk that ends where nothing is owed is one independent draw from the distribution of end states the
walks' step rule induces, and its state's class (the fingerprint under symmetry and stale events, as the
exhaustive search counts them) is the draw's *species*. From how often each class was drawn:

* **Good–Turing** ``unseen_mass = f1 / n`` (f1: classes drawn exactly once, n: draws) estimates the chance
  that the *next* walk ends in a class no walk has ended in yet;
* **Chao1** ``observed + f1² / (2·f2)`` (``f1·(f1 − 1) / 2`` when no class was drawn twice) is a lower-bound
  estimate of how many end-state classes the walks can reach at all.

Both are estimates under the walks' own distribution, not under a uniform one over states: a class the step
rule almost never reaches weighs almost nothing in them. They say how far a clean run is from having
seen what *walks* find, which is not the exhaustive search's guarantee.
"""

from __future__ import annotations

from collections import Counter


def end_class_estimates(counts: Counter) -> dict:
    """``counts``: end-state class -> walks that ended there. The JSON-ready estimates of the module docstring."""
    n = sum(counts.values())
    frequencies = Counter(counts.values())
    f1, f2 = frequencies.get(1, 0), frequencies.get(2, 0)
    chao1 = len(counts) + (f1 * f1 / (2 * f2) if f2 else f1 * (f1 - 1) / 2)
    return {"walks": n, "classes": len(counts), "seen_once": f1, "seen_twice": f2,
            "unseen_mass": round(f1 / n, 6) if n else None, "chao1_classes": round(chao1, 1),
            "note": "estimates under the walks' own distribution (Good-Turing: the chance the next walk ends in an "
                    "unseen class; Chao1: a lower-bound estimate of the end-state classes walks reach), not "
                    "exhaustive"}
