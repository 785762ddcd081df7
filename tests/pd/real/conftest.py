"""The real-transport tests need Mooncake's engine: they skip where it cannot be imported, except in CI
(``CI`` set), where a missing engine fails the run (.ci/run installs ``.[pd-real]`` and its libraries)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("CI"):
    import mooncake.engine  # noqa: F401 -- the real-transport tests must run in CI
else:
    pytest.importorskip("mooncake.engine", reason="pd-real: mooncake's engine does not import "
                        "(pip install '.[pd-real]'; apt-get install libibverbs1 librdmacm1 libnuma1)")
