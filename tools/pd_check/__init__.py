"""Exhaustive checking of the PD abort protocol at small bounds (TLA+-style explicit-state model
checking over the implementation the stress runs, not a re-model): every interleaving of events,
deliveries, faults and cancels within :class:`CheckBounds`, every state checked against the safety
invariants and every terminal state against the liveness ones (:mod:`tools.pd_check.invariants`)."""

from tools.pd_check.bounds import CheckBounds
from tools.pd_check.explorer import replay, run_check, shortest
from tools.pd_check.trace import format_trace, load_counterexample, save_counterexample

__all__ = ["CheckBounds", "run_check", "shortest", "replay", "format_trace", "save_counterexample", "load_counterexample"]
