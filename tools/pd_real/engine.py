"""A Mooncake transfer engine on loopback TCP, and page buffers in shared memory.

The KV page buffer of a decode process lives in a POSIX shared-memory segment: decode registers its
address with its own engine, and the test process maps the same segment to *watch* it (checksums per
page, read without the decode process's help — even while decode is stopped by SIGSTOP).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

POISON = 0xAB  # every byte of a page no one has written (or that was released)
HOST = "127.0.0.1"


def import_engine():
    """``mooncake.engine.TransferEngine``, or one ImportError that says what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the wheel, or one of its Debian libraries, is missing
        raise ImportError(
            "tools.pd_real needs mooncake-transfer-engine-non-cuda (pip install '.[dev]') and the "
            f"Debian libraries libibverbs1 librdmacm1 libnuma1; importing it failed: {exc}") from exc
    return TransferEngine


def open_engine():
    """An engine on loopback TCP with peer-to-peer handshakes; returns (engine, session id)."""
    engine = import_engine()()
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({HOST!r}, 'P2PHANDSHAKE', 'tcp'): expected 0, got {rc}")
    return engine, f"{HOST}:{engine.get_rpc_port()}"


def register(engine, addr: int, nbytes: int) -> None:
    rc = engine.register_memory(addr, nbytes)
    if rc != 0:
        raise RuntimeError(f"register_memory({addr:#x}, {nbytes}): expected 0, got {rc}")


@dataclass
class Pages:
    """``count`` pages of ``page_bytes`` in one shared-memory segment (``name`` attaches another process)."""

    shm: shared_memory.SharedMemory
    count: int
    page_bytes: int
    owner: bool

    @classmethod
    def create(cls, count: int, page_bytes: int) -> Pages:
        if count < 1 or page_bytes < 1:
            raise ValueError(f"pages: expected count >= 1 and page_bytes >= 1, got {count}, {page_bytes}")
        pages = cls(shared_memory.SharedMemory(create=True, size=count * page_bytes), count, page_bytes, True)
        pages.array[:] = POISON
        return pages

    @classmethod
    def attach(cls, name: str, count: int, page_bytes: int) -> Pages:
        return cls(shared_memory.SharedMemory(name=name), count, page_bytes, False)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def array(self) -> np.ndarray:  # [count, page_bytes] uint8, a view of the segment
        return np.ndarray((self.count, self.page_bytes), np.uint8, self.shm.buf)

    @property
    def addr(self) -> int:
        return self.array.ctypes.data

    def page_addr(self, page: int) -> int:
        return self.addr + page * self.page_bytes

    def checksums(self) -> list[int]:
        return [zlib.crc32(row) for row in self.array]

    def close(self) -> None:
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def fill(page_bytes: int, value: int) -> np.ndarray:
    """A source page: ``page_bytes`` bytes of ``value``."""
    return np.full(page_bytes, value, np.uint8)
