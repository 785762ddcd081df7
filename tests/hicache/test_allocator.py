"""Page allocator: refcounts, double free, out-of-range, exhaustion, reuse fences."""

from __future__ import annotations

import pytest

from hicache.allocator import OutOfPages, PageAllocator


def test_alloc_free_and_refcounts():
    a = PageAllocator(4)
    pages = a.alloc(3)
    assert len(set(pages)) == 3 and a.available == 1
    a.incref(pages[:1])  # a shared prefix page
    a.free(pages)
    assert a.refcount(pages[0]) == 1 and a.available == 3
    a.free(pages[:1])
    assert a.available == 4


def test_exhaustion_allocates_nothing():
    a = PageAllocator(3)
    a.alloc(2)
    with pytest.raises(OutOfPages, match="expected 2 free pages, got 1 of 3"):
        a.alloc(2)
    assert a.available == 1


def test_double_free_and_range_errors():
    a = PageAllocator(3, name="device pool")
    p = a.alloc(1)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    q = a.alloc(1)
    with pytest.raises(ValueError, match="double free"):
        a.free(q + q)  # one call freeing a page twice is caught before anything changes
    assert a.refcount(q[0]) == 1
    with pytest.raises(ValueError, match=r"device pool: page: expected 0 <= page < 3, got 7"):
        a.free([7])
    with pytest.raises(ValueError, match="incref: expected an allocated page"):
        a.incref([p[0]] if p[0] != q[0] else [2])
    with pytest.raises(ValueError, match="num_pages: expected an integer >= 1"):
        PageAllocator(0)


def test_fences_follow_freed_pages_to_their_next_owner():
    a = PageAllocator(2)
    pages = a.alloc(2)
    fence = object()
    a.free(pages[:1], fence=fence)
    a.free(pages[1:])
    again = a.alloc(2)
    assert a.fences(again) == [fence]
    assert a.fences(again) == []  # consumed


def test_reserved_padding_page_is_never_handed_out():
    a = PageAllocator(4, reserved=1)
    assert sorted(a.alloc(3)) == [1, 2, 3] and a.available == 0
    with pytest.raises(ValueError, match=r"reserved: expected 0 <= reserved < num_pages \(2\), got 2"):
        PageAllocator(2, reserved=2)
