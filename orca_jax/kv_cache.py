"""Host-side paged KV allocator: free list, per-request page tables, reservations (no jax).

The device pages live in the runner; this module only decides which page ids a request owns.
Page 0 is a scratch page that padding tokens write into on device, so it is never handed out.
"""

from __future__ import annotations


class KVCacheError(RuntimeError):
    """The allocator's bookkeeping was asked to do something impossible (a bug, not a full pool)."""


class KVCacheManager:
    """Pages 1..num_pages-1 handed out lazily, under reservations made once per request (ORCA Alg. 1).

    A request reserves pages for its whole life (prompt + max new tokens) when first scheduled, so a
    request that was admitted can always grow to its end: the pool can never deadlock. Pages are
    taken from the free list only when tokens need them (allocate_up_to) and all return at free().
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # LIFO free list; reversed so the first pages handed out are 1, 2, 3... (easy to read in tests).
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        # Per-page flag that catches a page freed twice or handed out twice.
        self._page_is_free = bytearray(b"\x01") * num_pages
        self._page_is_free[0] = 0
        self._page_tables: dict[str, list[int]] = {}
        self._reserved_pages: dict[str, int] = {}
        self._num_reserved_pages = 0

    # ---- counters -------------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but scratch page 0)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list (reserved-but-unallocated pages count as free)."""
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        """Pages currently owned by some request."""
        return self.num_usable_pages - len(self._free_pages)

    @property
    def num_reserved_pages(self) -> int:
        """Sum of all reservations, allocated or not."""
        return self._num_reserved_pages

    @property
    def num_unreserved_pages(self) -> int:
        """Pages no request has reserved: the room left for admitting new requests."""
        return self.num_usable_pages - self._num_reserved_pages

    @property
    def num_requests(self) -> int:
        """Requests holding a reservation."""
        return len(self._reserved_pages)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold num_tokens tokens."""
        return -(-num_tokens // self.page_size)

    # ---- reservation ----------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a reservation for num_tokens tokens fits in the unreserved pages."""
        return self.num_pages_for(num_tokens) <= self.num_unreserved_pages

    def has_reservation(self, request_id: str) -> bool:
        """Whether request_id holds a reservation."""
        return request_id in self._reserved_pages

    def reserve(self, request_id: str, num_tokens: int) -> None:
        """Reserve pages for num_tokens tokens (the request's whole life); allocates nothing yet."""
        if request_id in self._reserved_pages:
            raise KVCacheError(f"request {request_id!r} already holds a reservation")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        num_pages = self.num_pages_for(num_tokens)
        if num_pages > self.num_unreserved_pages:
            raise KVCacheError(f"cannot reserve {num_pages} pages for {request_id!r}: only "
                               f"{self.num_unreserved_pages} of {self.num_usable_pages} unreserved")
        self._reserved_pages[request_id] = num_pages
        self._page_tables[request_id] = []
        self._num_reserved_pages += num_pages

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Raise request_id's reservation to cover num_tokens if the unreserved pages allow.

        On-demand allocation: a request reserves what it holds plus what it is about to write, so
        the same accounting (and the same never-run-dry guarantee of allocate_up_to) covers both
        modes. False, changing nothing, when the pool cannot give the extra pages.
        """
        held = self._reserved_pages.get(request_id)
        if held is None:
            raise KVCacheError(f"request {request_id!r} has no reservation")
        extra = self.num_pages_for(num_tokens) - held
        if extra <= 0:
            return True
        if extra > self.num_unreserved_pages:
            return False
        self._reserved_pages[request_id] = held + extra
        self._num_reserved_pages += extra
        return True

    def num_reserved_for(self, request_id: str) -> int:
        """Pages request_id has reserved (0 if none): what freeing it would give back."""
        return self._reserved_pages.get(request_id, 0)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_up_to(self, request_id: str, num_tokens: int) -> None:
        """Make request_id own enough pages for num_tokens tokens, within its reservation."""
        table = self._page_tables.get(request_id)
        if table is None:
            raise KVCacheError(f"request {request_id!r} has no reservation")
        num_needed = self.num_pages_for(num_tokens)
        if num_needed > self._reserved_pages[request_id]:
            raise KVCacheError(f"request {request_id!r} needs {num_needed} pages for {num_tokens} "
                               f"tokens but reserved {self._reserved_pages[request_id]}")
        while len(table) < num_needed:
            # Cannot run dry: every request's pages stay within its reservation, and the
            # reservations together stay within the pool.
            page = self._free_pages.pop()
            if not self._page_is_free[page]:
                raise KVCacheError(f"page {page} on the free list is already in use")
            self._page_is_free[page] = 0
            table.append(page)

    def page_ids(self, request_id: str) -> list[int]:
        """The request's pages in token order. Read-only: the allocator's own list, not a copy."""
        return self._page_tables[request_id]

    def free(self, request_id: str) -> bool:
        """Return the request's pages and drop its reservation; False if it holds none."""
        table = self._page_tables.pop(request_id, None)
        if table is None:
            return False  # abort can race with finish: freeing twice is not an error
        self._num_reserved_pages -= self._reserved_pages.pop(request_id)
        self._return_pages(table)
        return True

    def _return_pages(self, pages: list[int]) -> None:
        for page in pages:
            if not 0 < page < self.num_pages:
                raise KVCacheError(f"page {page} is not a usable page")
            if self._page_is_free[page]:
                raise KVCacheError(f"page {page} freed twice")
            self._page_is_free[page] = 1
            self._free_pages.append(page)
