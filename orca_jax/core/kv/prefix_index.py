"""Automatic prefix caching: full KV pages indexed by their content, kept past their request (no jax).

A full page's K/V depend on its tokens and on every token before it (and on the adapter, through
the request's adapter and cache salt), so its key chains the previous page's key: key_i =
hash((key_{i-1}, tokens of page i, salt)), the salt being Request.kv_salt. A request's keys are
computed once per page of known tokens and kept on the request (`page_keys`). The index maps a key to the page holding that content; a page whose last
holder leaves stays in the index, on an LRU of evictable pages that the allocator takes from only
when its free list is empty (evicting a page drops its key).

Hash collisions cannot alias content: every entry keeps its tokens, its salt and the serial number of
its parent's entry (a page evicted and republished gets a new serial), and a lookup matches a page
only when all three equal the request's, page by page from the first. The index is therefore exact;
the hash only finds the candidate.
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable, NamedTuple, Sequence

from orca_jax.core.request import Request

ROOT_KEY = 0  # the "previous key" of a request's first page
_ROOT_SERIAL = -1


class _Entry(NamedTuple):  # a NamedTuple: one is made per published page, on the scheduling path
    key: int
    serial: int  # unique per publication
    parent_serial: int  # the entry of the page before it (_ROOT_SERIAL for a first page)
    tokens: tuple[int, ...]
    salt: tuple


def extend_page_keys(request: Request, page_size: int, hash_fn: Callable[[tuple], int] = hash) -> list[int]:
    """request.page_keys, extended (with request.page_tokens) over every full page of its known tokens
    (prompt + outputs)."""
    keys, pages = request.page_keys, request.page_tokens
    num_full = request.num_tokens // page_size
    if len(keys) < num_full:
        tokens = request.token_ids_at(len(keys) * page_size, (num_full - len(keys)) * page_size)
        parent = keys[-1] if keys else ROOT_KEY
        salt = request.kv_salt
        for i in range(0, len(tokens), page_size):
            page = tuple(tokens[i:i + page_size])
            parent = hash_fn((parent, page, salt))
            keys.append(parent)
            pages.append(page)
    return keys


class PrefixIndex:
    """Which page holds which content, and which cached pages no request holds (LRU, oldest first)."""

    def __init__(self, num_pages: int, page_size: int, hash_fn: Callable[[tuple], int] = hash):
        self.page_size = page_size
        self.hash_fn = hash_fn
        self._page_of_key: dict[int, int] = {}
        self._entries: list[_Entry | None] = [None] * num_pages  # by page id
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._serials = itertools.count()

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages whose content is indexed (held by requests or evictable)."""
        return len(self._page_of_key)

    def is_cached(self, page: int) -> bool:
        return self._entries[page] is not None

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def chain_end(self, pages: Sequence[int]) -> tuple[int, int]:
        """(len(pages), the serial of the last one's entry): what publish's `done` is for a request
        whose first pages are these indexed pages (cached_prefix hits)."""
        return (len(pages), self._entries[pages[-1]].serial) if pages else (0, _ROOT_SERIAL)

    def lookup(self, request: Request, max_pages: int) -> list[int]:
        """Pages holding the request's first pages (at most max_pages), as far as their content
        matches exactly, from its first page on."""
        keys = extend_page_keys(request, self.page_size, self.hash_fn)
        parent_serial = _ROOT_SERIAL
        found: list[int] = []
        for i in range(min(max_pages, len(keys))):
            page = self._page_of_key.get(keys[i])
            entry = None if page is None else self._entries[page]
            if entry is None or entry.parent_serial != parent_serial or entry.salt != request.kv_salt \
                    or entry.tokens != request.page_tokens[i]:
                break
            found.append(page)
            parent_serial = entry.serial
        return found

    def publish(self, request: Request, pages: Sequence[int], stop: int,
                done: tuple[int, int] = (0, _ROOT_SERIAL)) -> tuple[int, int]:
        """Index the request's pages up to stop-1 (full, their K/V written or being written by a batch
        already dispatched). `done`: (pages of this request already matched in the index, the serial
        of the last one's entry), as the previous call returned; returns the new pair.

        A page whose content is indexed already (another page holds it) stays private, and the chain
        continues through the indexed one; a key taken by other content (a hash collision) ends it.
        """
        keys = extend_page_keys(request, self.page_size, self.hash_fn)
        i, serial = done
        while i < min(stop, len(keys)):
            tokens = request.page_tokens[i]
            holder = self._page_of_key.get(keys[i])
            if holder is not None:
                entry = self._entries[holder]
                if entry.parent_serial != serial or entry.tokens != tokens or entry.salt != request.kv_salt:
                    break  # a collision: this content cannot be indexed under its key
            else:
                entry = _Entry(keys[i], next(self._serials), serial, tokens, request.kv_salt)
                self._entries[pages[i]] = entry
                self._page_of_key[keys[i]] = pages[i]
            serial = entry.serial
            i += 1
        return i, serial

    def release(self, page: int) -> bool:
        """A cached page's last holder let it go: it becomes evictable (True). False: not cached."""
        if self._entries[page] is None:
            return False
        self._evictable[page] = None  # the most recently used end
        return True

    def take(self, page: int) -> None:
        """A request holds an evictable page again (a hit): it is no longer evictable."""
        self._evictable.pop(page, None)

    def evict_oldest(self) -> int | None:
        """Drop the least recently used evictable page from the index; returns it, or None."""
        if not self._evictable:
            return None
        page, _ = self._evictable.popitem(last=False)
        self._forget(page)
        return page

    def forget(self, page: int) -> None:
        """Drop a page from the index (e.g. a reset); it must not be evictable."""
        if page in self._evictable:
            raise ValueError(f"page {page} is evictable: evict it instead")
        self._forget(page)

    def forget_range(self, start: int, stop: int) -> None:
        """Drop pages start..stop-1 from the index, evictable or not (their memory is going away)."""
        for page in range(start, stop):
            self._evictable.pop(page, None)
            self._forget(page)

    def _forget(self, page: int) -> None:
        entry = self._entries[page]
        if entry is not None:
            del self._page_of_key[entry.key]
            self._entries[page] = None

    def evictable_pages(self) -> list[int]:
        """Evictable pages, least recently used first."""
        return list(self._evictable)

    def cached_pages(self) -> list[int]:
        return list(self._page_of_key.values())
