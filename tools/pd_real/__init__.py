"""The abort protocol's data and control planes on real parts: Mooncake's transfer engine (TCP
transport, ``P2PHANDSHAKE`` metadata) and ZMQ, between real OS processes on loopback.

``engine`` opens a Mooncake engine and maps a page buffer both a decode process and its watcher see;
``probes`` measures the assumptions the protocol makes about late writes; ``storm`` runs the seeded fault
storm on a decode process and its prefill ranks. A maintainers' tool (``python -m tools.pd_real``, see
the README beside it); the ``dev`` extra installs the pinned wheels; nothing in ``layersplit`` imports it.
"""
