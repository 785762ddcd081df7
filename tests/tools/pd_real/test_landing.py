"""The landing checker: its page verdicts, and release after a writer's death on real memory — the
legacy immediate release is caught (late writes of the dead writer's tag on released pages), the
fenced release (deregister first) has none."""

from __future__ import annotations

import numpy as np
import pytest

from tools.pd_real.engine import POISON
from tools.pd_real.landing import ReleasedWatch, check, owner, stamp
from tools.pd_real.release import release_after_death
from layersplit.pd.abort.transfer_engine import WriteTag

A, B = WriteTag(3, 1, 0), WriteTag(3, 2, 0)


@pytest.mark.parametrize("page_bytes", [17, 4096, 4099])
def test_page_verdicts(page_bytes):
    page = stamp(page_bytes, A)
    assert check(page, A) == "ok" and check(page, B) == "stale" and owner(page) == A
    assert check(np.full(page_bytes, POISON, np.uint8), A) == "poison"
    torn = page.copy()
    torn[-1] ^= 1
    assert check(torn, A) == "torn" and owner(torn) is None
    mixed = np.concatenate([page[: page_bytes // 2 + 8], stamp(page_bytes, B)[page_bytes // 2 + 8:]])
    assert check(mixed, A) == "torn"


def test_a_page_too_small_for_its_header_is_refused():
    with pytest.raises(ValueError, match="page_bytes: expected > 16, got 16"):
        stamp(16, A)


def test_released_watch_sees_a_write_after_release():
    pages = np.stack([stamp(64, A), stamp(64, B), stamp(64, A)])
    watch = ReleasedWatch(pages)
    watch.release([0, 1])
    assert watch.late() == []
    pages[1, 5] = 0  # a late write into a released page
    pages[2, 5] = 0  # a write into a page never released: not watched
    assert watch.late() == [1]
    watch.reuse([1])
    assert watch.late() == []


@pytest.mark.timeout(90)
def test_legacy_release_after_death_is_caught_by_the_landing_checker():
    r = release_after_death("legacy", count=512, stall_s=0.5)
    assert r["warm_status"] == 0 and r["warm_page_ok"] and r["unread_bytes_at_kill"] >= 64 << 10, r
    assert r["late_writes"] > 0 and r["late_owners"] == [7], r  # whole pages of the dead writer


@pytest.mark.timeout(90)
def test_fenced_release_after_death_has_no_late_write():
    r = release_after_death("fenced", count=512, stall_s=0.5)
    assert r["warm_status"] == 0 and r["warm_page_ok"] and r["unread_bytes_at_kill"] >= 64 << 10, r
    assert r["deregister_rc"] == 0 and r["late_writes"] == 0, r
