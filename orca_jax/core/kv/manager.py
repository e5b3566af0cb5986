"""Host-side paged KV allocator: free list, per-request page tables, reservations, shared cached pages
(no jax).

The device pages live in the runner; this module only decides which page ids a request holds.
Page 0 is a scratch page that padding tokens write into on device, so it is never handed out.

With prefix caching (prefix_index.py), a full page of known content can be held by several requests
at once (a reference count per page) and outlives its holders: when the last one lets go, a cached
page becomes evictable instead of free. Evictable pages count as free everywhere (admission, growth,
the counters); the allocator takes one, dropping its content, only when the free list is empty.

Reservations keep ORCA's guarantee: a request's reservation is the number of pages it may hold; what
it holds is counted once however many requests share it, and what it may still take (`pending`) is
promised out of the free and evictable pages, so `allocate_up_to` can never run dry.

A fine-tuning job borrows the pool's top `lendable_pages` (finetune/kv_loan.py). Those pages have a free list
of their own that is drawn from only when the rest of the pool is held, so under light load they
stay free and can be lent without preempting anyone. `lend` succeeds only then (nothing held up
there, every reservation fits below); while lent the pool is that much smaller; `reclaim` gives the
pages back.
"""

from __future__ import annotations

from typing import Callable

from orca_jax.core.kv.prefix_index import PrefixIndex
from orca_jax.core.request import Request


class KVCacheError(RuntimeError):
    """The allocator's bookkeeping was asked to do something impossible (a bug, not a full pool)."""


class KVCacheManager:
    """Pages 1..num_pages-1 handed out lazily, under reservations made once per request (ORCA Alg. 1).

    A request reserves pages for its whole life (prompt + max new tokens) when first scheduled, so a
    request that was admitted can always grow to its end: the pool can never deadlock. Pages are
    taken from the free list only when tokens need them (allocate_up_to) and all return at free().
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False,
                 hash_fn: Callable[[tuple], int] = hash, lendable_pages: int = 0):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not 0 <= lendable_pages <= num_pages - 2:
            raise ValueError(f"lendable_pages must leave at least one usable page: {lendable_pages} of {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_index = PrefixIndex(num_pages, page_size, hash_fn) if enable_prefix_caching else None
        # Pages [loan_start, num_pages) are the ones a fine-tuning job may borrow; _limit is where the
        # pool ends now (loan_start while lent, else num_pages).
        self.loan_start = num_pages - lendable_pages
        self._limit = num_pages
        # LIFO free lists; reversed so the first pages handed out are 1, 2, 3... (easy to read in tests).
        self._free_pages: list[int] = list(range(self.loan_start - 1, 0, -1))
        self._free_lendable: list[int] = list(range(num_pages - 1, self.loan_start - 1, -1))
        self._refs = [0] * num_pages  # requests holding each page; 0: free or evictable
        self._page_tables: dict[str, list[int]] = {}
        self._pending: dict[str, int] = {}  # pages a request may still take beyond its table
        self._num_pending = 0
        self._num_held = 0  # pages with a holder
        # Prefix caching: (pages of the request matched in the index, the last one's serial).
        self._indexed: dict[str, tuple[int, int]] = {}
        self.num_prefix_cache_queries = 0  # tokens looked up at admission, since start
        self.num_prefix_cache_hits = 0  # tokens found cached (at admission or later), so not computed

    # ---- counters -------------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        """Pages that can be handed out now (all but scratch page 0, and the lent ones while lent)."""
        return self._limit - 1

    @property
    def max_usable_pages(self) -> int:
        """Pages that can ever be handed out (once lent pages come back): what one request may need."""
        return self.num_pages - 1

    @property
    def lent(self) -> bool:
        return self._limit < self.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds: the free list and the evictable cached pages."""
        return self.num_usable_pages - self._num_held

    @property
    def num_used_pages(self) -> int:
        """Pages some request holds (a shared page once)."""
        return self._num_held

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no request holds, kept for later hits until the free list runs dry."""
        return 0 if self.prefix_index is None else self.prefix_index.num_evictable_pages

    @property
    def num_reserved_pages(self) -> int:
        """Pages held plus pages promised to requests: what admission cannot give away."""
        return self._num_held + self._num_pending

    @property
    def num_unreserved_pages(self) -> int:
        """Pages no request has reserved: the room left for admitting new requests."""
        return self.num_usable_pages - self.num_reserved_pages

    @property
    def num_requests(self) -> int:
        """Requests holding a reservation."""
        return len(self._page_tables)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold num_tokens tokens."""
        return -(-num_tokens // self.page_size)

    # ---- prefix caching -------------------------------------------------------------------------
    def cached_prefix(self, request: Request, max_tokens: int) -> list[int]:
        """Pages already holding the request's first full pages (at most max_tokens tokens of them),
        content checked exactly; [] with prefix caching off."""
        if self.prefix_index is None:
            return []
        return self.prefix_index.lookup(request, max_tokens // self.page_size)

    def admission_cost(self, num_tokens: int, hit: list[int]) -> int:
        """Pages a reservation for num_tokens with these cached pages takes from the unreserved ones:
        every page except hits another request already holds."""
        return self.num_pages_for(num_tokens) - sum(1 for page in hit if self._refs[page])

    def publish(self, request: Request, num_tokens: int) -> None:
        """Index the request's full pages among its first num_tokens tokens, whose K/V are written or
        being written by a batch already dispatched (a no-op with prefix caching off)."""
        if self.prefix_index is None:
            return
        rid = request.request_id
        done = self._indexed.get(rid)
        stop = num_tokens // self.page_size
        if done is not None and stop <= done[0]:
            return  # the common case, once per request per iteration: no page completed
        stop = min(stop, request.num_tokens // self.page_size)  # pages of known tokens only
        done = done or self.prefix_index.chain_end(())
        if stop > done[0]:
            self._indexed[rid] = self.prefix_index.publish(request, self._page_tables[rid], stop, done)

    def extend_with_cached(self, request: Request, num_tokens: int, max_tokens: int) -> int:
        """A request holding exactly its first num_tokens tokens' pages (page-aligned, nothing more)
        takes the cached pages that follow, up to max_tokens in all, in place of pages it would
        allocate; returns the tokens gained (0 with prefix caching off)."""
        rid = request.request_id
        table = self._page_tables[rid]
        if self.prefix_index is None or num_tokens % self.page_size or len(table) != num_tokens // self.page_size:
            return 0
        found = self.prefix_index.lookup(request, max_tokens // self.page_size)
        # The hit replaces pages the reservation promised, never more: the reservation stays as it was.
        hit = found[len(table):len(table) + self._pending[rid]]
        if not hit:
            return 0
        self._take(hit)
        table += hit
        self._pending[rid] -= len(hit)
        self._num_pending -= len(hit)
        self._indexed[rid] = self.prefix_index.chain_end(found[:len(table)])
        self.num_prefix_cache_hits += len(hit) * self.page_size
        return len(hit) * self.page_size

    def reset_prefix_cache(self) -> int:
        """Forget every cached page's content (evictable pages become free); returns pages forgotten."""
        if self.prefix_index is None:
            return 0
        forgotten = 0
        while (page := self.prefix_index.evict_oldest()) is not None:
            (self._free_pages if page < self.loan_start else self._free_lendable).append(page)
            forgotten += 1
        for page in self.prefix_index.cached_pages():
            self.prefix_index.forget(page)
            forgotten += 1
        self._indexed.clear()
        return forgotten

    # ---- the loan to fine-tuning (finetune/kv_loan.py) -------------------------------------------
    def can_lend(self) -> bool:
        """Whether the lendable pages could go now: none held, every reservation fits below them."""
        if self.lent or self.loan_start == self.num_pages:
            return False
        return not any(self._refs[self.loan_start:]) and self.num_reserved_pages <= self.loan_start - 1

    def lend(self) -> bool:
        """Withdraw the lendable pages from the pool (cached content on them is forgotten); False,
        changing nothing, unless can_lend."""
        if not self.can_lend():
            return False
        if self.prefix_index is not None:
            self.prefix_index.forget_range(self.loan_start, self.num_pages)
        self._free_lendable.clear()  # every lendable page is free (none held): nothing is lost
        self._limit = self.loan_start
        return True

    def reclaim(self) -> None:
        """The lent pages are back in the pool, free (their old content is gone)."""
        if not self.lent:
            return
        self._free_lendable = list(range(self.num_pages - 1, self.loan_start - 1, -1))
        self._limit = self.num_pages

    def _take(self, pages: list[int]) -> None:
        for page in pages:
            if self._refs[page] == 0:
                self._num_held += 1
                self.prefix_index.take(page)
            self._refs[page] += 1

    # ---- reservation ----------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a reservation for num_tokens tokens (no cached pages) fits in the unreserved pages."""
        return self.num_pages_for(num_tokens) <= self.num_unreserved_pages

    def has_reservation(self, request_id: str) -> bool:
        """Whether request_id holds a reservation."""
        return request_id in self._page_tables

    def reserve(self, request_id: str, num_tokens: int, hit: list[int] = (), num_queried: int = 0) -> None:
        """Reserve pages for num_tokens tokens (the request's whole life), starting from the cached
        pages `hit` (cached_prefix over num_queried tokens), which it holds from now on; allocates
        nothing else yet."""
        if request_id in self._page_tables:
            raise KVCacheError(f"request {request_id!r} already holds a reservation")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        num_pages = self.num_pages_for(num_tokens)
        if len(hit) > num_pages:
            raise KVCacheError(f"{len(hit)} cached pages exceed the {num_pages} pages reserved")
        cost = self.admission_cost(num_tokens, list(hit))
        if cost > self.num_unreserved_pages:
            raise KVCacheError(f"cannot reserve {cost} pages for {request_id!r}: only "
                               f"{self.num_unreserved_pages} of {self.num_usable_pages} unreserved")
        self._take(list(hit))
        self._page_tables[request_id] = list(hit)
        self._pending[request_id] = num_pages - len(hit)
        self._num_pending += num_pages - len(hit)
        if hit:
            self._indexed[request_id] = self.prefix_index.chain_end(list(hit))
        if self.prefix_index is not None:
            self.num_prefix_cache_queries += num_queried
            self.num_prefix_cache_hits += len(hit) * self.page_size

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Raise request_id's reservation to cover num_tokens if the unreserved pages allow.

        On-demand allocation: a request reserves what it holds plus what it is about to write, so
        the same accounting (and the same never-run-dry guarantee of allocate_up_to) covers both
        modes. False, changing nothing, when the pool cannot give the extra pages.
        """
        if request_id not in self._page_tables:
            raise KVCacheError(f"request {request_id!r} has no reservation")
        extra = self.num_pages_for(num_tokens) - self.num_reserved_for(request_id)
        if extra <= 0:
            return True
        if extra > self.num_unreserved_pages:
            return False
        self._pending[request_id] += extra
        self._num_pending += extra
        return True

    def num_reserved_for(self, request_id: str) -> int:
        """Pages request_id has reserved, held or still to take (0 if none)."""
        table = self._page_tables.get(request_id)
        return 0 if table is None else len(table) + self._pending[request_id]

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_up_to(self, request_id: str, num_tokens: int) -> list[int]:
        """Make request_id hold enough pages for num_tokens tokens, within its reservation; returns its
        pages (page_ids: the allocator's own list, read-only), so a planner needs one lookup a row."""
        table = self._page_tables.get(request_id)
        if table is None:
            raise KVCacheError(f"request {request_id!r} has no reservation")
        num_needed = -(-num_tokens // self.page_size)
        if len(table) >= num_needed:
            return table  # the common case, per decoding request per iteration: its last page has room
        if num_needed > self.num_reserved_for(request_id):
            raise KVCacheError(f"request {request_id!r} needs {num_needed} pages for {num_tokens} "
                               f"tokens but reserved {self.num_reserved_for(request_id)}")
        while len(table) < num_needed:
            # Cannot run dry: pending pages are promised out of the free and evictable ones.
            page = self._take_free_page()
            if self._refs[page]:
                raise KVCacheError(f"page {page} on the free list is already in use")
            self._refs[page] = 1
            self._num_held += 1
            self._pending[request_id] -= 1
            self._num_pending -= 1
            table.append(page)
        return table

    def _take_free_page(self) -> int:
        """The rest of the pool's free pages first, then the lendable ones (while not lent), then the
        least recently used evictable page."""
        if self._free_pages:
            return self._free_pages.pop()
        if self._free_lendable and not self.lent:
            return self._free_lendable.pop()
        return self.prefix_index.evict_oldest()

    def page_ids(self, request_id: str) -> list[int]:
        """The request's pages in token order. Read-only: the allocator's own list, not a copy."""
        return self._page_tables[request_id]

    def free(self, request_id: str) -> bool:
        """Let go of the request's pages and drop its reservation; False if it holds none."""
        table = self._page_tables.pop(request_id, None)
        if table is None:
            return False  # abort can race with finish: freeing twice is not an error
        self._num_pending -= self._pending.pop(request_id)
        self._indexed.pop(request_id, None)
        self._return_pages(table)
        return True

    def _return_pages(self, pages: list[int]) -> None:
        freed = []
        # Last pages first into the LRU: it then evicts a prefix's tail before its head, which more
        # requests share. The free list takes them in order (LIFO: the last page freed is reused first).
        for page in reversed(pages):
            if not 0 < page < self.num_pages:
                raise KVCacheError(f"page {page} is not a usable page")
            if self._refs[page] == 0:
                raise KVCacheError(f"page {page} freed twice")
            self._refs[page] -= 1
            if self._refs[page]:
                continue  # another request still holds it
            self._num_held -= 1
            if self.prefix_index is None or not self.prefix_index.release(page):
                freed.append(page)
        for page in reversed(freed):
            (self._free_pages if page < self.loan_start else self._free_lendable).append(page)
