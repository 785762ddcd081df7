"""Maintainers' tools, run from a checkout and never shipped in the wheel: :mod:`tools.pd_check` (the PD abort
protocol's exhaustive model checker) and :mod:`tools.pd_real` (the protocol on real processes: Mooncake's transfer
engine and ZMQ, probes of its assumptions and fault storms). Each folder's README says what it proves and how to run
it. They import the library (``layersplit``) and its command-line helpers; nothing in the library imports them."""
