"""The abort protocol's data and control planes on real parts: Mooncake's transfer engine (TCP
transport, ``P2PHANDSHAKE`` metadata) and ZMQ, between real OS processes on loopback.

``engine`` opens a Mooncake engine and maps a page buffer both a decode process and its watcher see;
``probes`` measures the assumptions the protocol makes about late writes (issue 28, item 4). The
optional extra ``.[pd-real]`` installs the pinned wheels; nothing else in ``pd`` imports this package.
"""
