"""KVCacheManager: reservations, lazy allocation, free list bookkeeping (plain Python, no jax)."""

import pytest

from orca_jax.core.kv.manager import KVCacheError, KVCacheManager
from orca_jax.worker.kv_pool import pages_for_budget


def assert_consistent(kv: KVCacheManager) -> None:
    assert kv.num_free_pages + kv.num_used_pages == kv.num_usable_pages
    assert kv.num_reserved_pages + kv.num_unreserved_pages == kv.num_usable_pages
    assert kv.num_used_pages <= kv.num_reserved_pages <= kv.num_usable_pages
    owned = [p for table in kv._page_tables.values() for p in table]
    assert len(owned) == len(set(owned)) == kv.num_used_pages
    assert 0 not in owned


def test_counters_and_lazy_allocation():
    kv = KVCacheManager(num_pages=11, page_size=4)
    assert (kv.num_usable_pages, kv.num_free_pages, kv.num_used_pages) == (10, 10, 0)
    assert kv.can_reserve(40) and not kv.can_reserve(41)

    kv.reserve("a", 10)  # 3 pages reserved, none allocated yet
    assert (kv.num_reserved_pages, kv.num_unreserved_pages, kv.num_used_pages) == (3, 7, 0)
    assert kv.page_ids("a") == []
    kv.allocate_up_to("a", 1)
    assert kv.page_ids("a") == [1]
    kv.allocate_up_to("a", 4)  # still fits in page 1
    assert kv.page_ids("a") == [1]
    kv.allocate_up_to("a", 5)
    assert kv.page_ids("a") == [1, 2]
    kv.allocate_up_to("a", 3)  # never shrinks
    assert kv.page_ids("a") == [1, 2]
    assert (kv.num_used_pages, kv.num_free_pages) == (2, 8)
    assert_consistent(kv)

    with pytest.raises(KVCacheError, match="reserved 3"):
        kv.allocate_up_to("a", 13)  # 4 pages > reservation
    kv.allocate_up_to("a", 12)
    assert kv.num_used_pages == 3
    assert_consistent(kv)


def test_reserve_refusals():
    kv = KVCacheManager(num_pages=5, page_size=2)
    kv.reserve("a", 6)
    with pytest.raises(KVCacheError, match="already"):
        kv.reserve("a", 1)
    with pytest.raises(KVCacheError, match="only 1 of 4"):
        kv.reserve("b", 3)
    with pytest.raises(KVCacheError, match="no reservation"):
        kv.allocate_up_to("zzz", 1)
    with pytest.raises(ValueError):
        kv.reserve("c", 0)
    with pytest.raises(ValueError):
        KVCacheManager(num_pages=1, page_size=2)


def test_free_returns_pages_and_reservation_at_once():
    kv = KVCacheManager(num_pages=9, page_size=2)
    kv.reserve("a", 8)
    kv.allocate_up_to("a", 5)
    kv.reserve("b", 4)
    kv.allocate_up_to("b", 4)
    assert kv.free("a") is True
    assert (kv.num_used_pages, kv.num_reserved_pages, kv.num_requests) == (2, 2, 1)
    assert not kv.has_reservation("a")
    assert kv.free("a") is False  # abort racing with finish: a no-op
    assert kv.free("never-seen") is False
    kv.free("b")
    assert kv.num_free_pages == kv.num_usable_pages and kv.num_reserved_pages == 0
    assert sorted(kv._free_pages) == list(range(1, 9))
    assert_consistent(kv)


def test_page_double_free_raises():
    kv = KVCacheManager(num_pages=4, page_size=1)
    kv.reserve("a", 2)
    kv.allocate_up_to("a", 2)
    pages = list(kv.page_ids("a"))
    kv.free("a")
    with pytest.raises(KVCacheError, match="freed twice"):
        kv._return_pages(pages[:1])
    with pytest.raises(KVCacheError, match="not a usable page"):
        kv._return_pages([0])


def test_page_zero_never_handed_out_and_lifo_reuse():
    kv = KVCacheManager(num_pages=6, page_size=1)  # token-granular (FineInfer)
    kv.reserve("a", 5)
    kv.allocate_up_to("a", 5)
    assert sorted(kv.page_ids("a")) == [1, 2, 3, 4, 5]
    assert kv.num_free_pages == 0 and not kv.can_reserve(1)
    kv.free("a")
    kv.reserve("b", 1)
    kv.allocate_up_to("b", 1)
    assert kv.page_ids("b") == [5]  # the last page freed is the first reused
    assert_consistent(kv)


@pytest.mark.parametrize("page_size", [1, 16])
def test_many_requests_stay_within_reservations(page_size):
    kv = KVCacheManager(num_pages=40, page_size=page_size)
    lengths = {}
    rid = 0
    while kv.can_reserve(3 * page_size):
        kv.reserve(str(rid), 3 * page_size)
        lengths[str(rid)] = 0
        rid += 1
    assert kv.num_reserved_pages == 39 - 39 % 3
    for step in range(3 * page_size):
        for r in lengths:
            lengths[r] += 1
            kv.allocate_up_to(r, lengths[r])
            assert len(kv.page_ids(r)) == kv.num_pages_for(lengths[r])
        assert_consistent(kv)
    for r in lengths:
        kv.free(r)
    assert kv.num_free_pages == kv.num_usable_pages


def test_pages_for_budget():
    assert pages_for_budget(kv_bytes_per_token=100, page_size=16, budget_bytes=16_000) == 10
    assert pages_for_budget(100, 16, 15_999) == 9
    assert pages_for_budget(100, 1, 0) == 0
    with pytest.raises(ValueError):
        pages_for_budget(0, 16, 100)


def test_grow_raises_the_reservation_only_while_the_pool_allows():
    kv = KVCacheManager(num_pages=5, page_size=4)  # 4 usable pages
    kv.reserve("a", 4)
    kv.reserve("b", 4)
    assert kv.grow("a", 4) and kv.num_reserved_for("a") == 1  # already covered
    assert kv.grow("a", 12) and kv.num_reserved_for("a") == 3
    assert not kv.grow("b", 8) and kv.num_reserved_for("b") == 1  # nothing changed
    kv.allocate_up_to("a", 12)
    assert_consistent(kv)
    kv.free("a")
    assert kv.grow("b", 16) and kv.num_unreserved_pages == 0
    with pytest.raises(KVCacheError):
        kv.grow("a", 4)


def test_lendable_pages_go_last_and_are_lent_only_when_free():
    kv = KVCacheManager(num_pages=10, page_size=2, lendable_pages=4)  # pages 6-9 lendable
    assert (kv.loan_start, kv.num_usable_pages, kv.max_usable_pages) == (6, 9, 9)
    kv.reserve("a", 10)
    kv.allocate_up_to("a", 10)
    assert kv.page_ids("a") == [1, 2, 3, 4, 5]
    kv.reserve("b", 4)
    kv.allocate_up_to("b", 4)
    assert kv.page_ids("b") == [6, 7]  # the rest of the pool is held: now the lendable pages
    assert not kv.can_lend() and not kv.lend()  # held up there
    kv.free("b")
    kv.reserve("c", 2)  # reserved, nothing allocated: the smaller pool could not keep the promise
    assert not kv.lend()
    kv.free("c")
    assert kv.lend() and kv.lent
    assert (kv.num_usable_pages, kv.max_usable_pages, kv.num_free_pages) == (5, 9, 0)
    assert not kv.can_reserve(2)
    assert_consistent(kv)
    kv.free("a")
    kv.reserve("d", 10)
    kv.allocate_up_to("d", 10)
    assert max(kv.page_ids("d")) < kv.loan_start  # never a lent page
    kv.reclaim()
    assert not kv.lent and (kv.num_usable_pages, kv.num_unreserved_pages) == (9, 4)
    kv.reserve("e", 8)
    kv.allocate_up_to("e", 8)
    assert sorted(kv.page_ids("e")) == [6, 7, 8, 9]
    assert_consistent(kv)


def test_a_pool_without_lendable_pages_never_lends():
    kv = KVCacheManager(num_pages=10, page_size=2)
    assert kv.loan_start == 10 and not kv.can_lend() and not kv.lend() and not kv.lent
    with pytest.raises(ValueError, match="lendable_pages"):
        KVCacheManager(num_pages=10, page_size=2, lendable_pages=9)
