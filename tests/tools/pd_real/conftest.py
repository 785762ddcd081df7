"""The real-transport tests need Mooncake's engine: each skips, with the import's error as its reason,
where the engine cannot be imported — except in CI (``CI`` set), where a missing engine fails the run
(.ci/run installs ``.[dev]`` and the Debian libraries)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent

if os.environ.get("CI"):
    import mooncake.engine  # noqa: F401 -- the real-transport tests must run in CI

    MISSING = None
else:
    try:
        import mooncake.engine  # noqa: F401
        MISSING = None
    except ImportError as exc:  # the wheel, or a Debian library it links (libibverbs1, librdmacm1, libnuma1)
        MISSING = (f"pd-real: mooncake's engine does not import ({exc}); pip install '.[dev]' and "
                   "apt-get install libibverbs1 librdmacm1 libnuma1")


def pytest_collection_modifyitems(config, items):
    if MISSING is None:
        return
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=MISSING))
