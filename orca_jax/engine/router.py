"""Which data-parallel replica takes a request: the one holding its prompt's prefix, else the least loaded.

Replicas are whole engines, each on its own devices with its own KV pool and prefix cache, so a
conversation's next turn is cheap only on the replica that served the last one. The router keeps a
bounded map from prompt-prefix keys to the replica that last took them: keys of every full page of
the prompt, chained as the prefix cache chains them (core/kv/prefix_index.py: a page's key covers
every token before it and the request's KV salt), so the longest known prefix wins. Affinity yields to
load: a replica more than `imbalance` requests busier than the least loaded one is passed over (a
hot conversation must not pile every request onto one replica).

With several API server processes (`serve --api-server-count N`) each routes on its own, and a chat's
next turn may reach any of them: they share the map (SharedPrefixOwners, arrays every API server
maps) and compute the same keys (a tuple of ints hashes the same in every process of one Python,
unlike a str, so an adapter's name enters as a stable digest).

Host only, no jax: the front end routes before any engine sees the request.
"""

from __future__ import annotations

import collections
import hashlib
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from orca_jax.lora.request import LoRARequest

ROOT_KEY = 0  # the "previous key" of a prompt's first page


def prefix_keys(token_ids: Sequence[int], page_size: int, salt: Hashable = ()) -> list[int]:
    """Chained keys of each full page of token_ids: key_i = hash((key_{i-1}, page i's tokens, salt))."""
    keys, parent = [], ROOT_KEY
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash((parent, tuple(token_ids[start:start + page_size]), salt))
        keys.append(parent)
    return keys


def adapter_salt(lora_request: LoRARequest | None) -> tuple[int, ...]:
    """route()'s salt for a request: its adapter's name (an adapter's KV differs from the base model's),
    as a digest that is the same in every process."""
    if lora_request is None:
        return ()
    return (int.from_bytes(hashlib.blake2b(lora_request.lora_name.encode(), digest_size=8).digest(), "little"),)


class PrefixOwners(Protocol):
    """Which replica last took each prefix key."""

    def longest(self, keys: Sequence[int]) -> int | None:
        """The owner of the last of `keys` (a prompt's chain) that has one; None if none has."""

    def claim(self, keys: Sequence[int], replica: int) -> None:
        """`replica` now holds these keys' pages."""


class LocalPrefixOwners:
    """One process's map: an LRU of at most max_keys keys."""

    def __init__(self, max_keys: int = 1 << 16):
        self.max_keys = max_keys
        self._owner: collections.OrderedDict[int, int] = collections.OrderedDict()  # key -> replica, LRU

    def longest(self, keys: Sequence[int]) -> int | None:
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner is not None:
                return owner
        return None

    def claim(self, keys: Sequence[int], replica: int) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owner)


class SharedPrefixOwners:
    """A map several processes share: a direct-mapped table (a key's slot is its low bits; a newer key
    evicts an older one in its slot), whose arrays every API server maps (engine/shared_arrays.py).
    Two processes writing at once can leave a slot's key beside the other's owner: a wrong hint sends
    one request where its prefix is not, which costs a recompute, never a wrong answer."""

    def __init__(self, keys: np.ndarray, owners: np.ndarray):
        if keys.shape != owners.shape or len(keys) & (len(keys) - 1):
            raise ValueError("keys and owners must be one power-of-two number of slots")
        self._keys = keys  # i64[slots]
        self._owners = owners  # i64[slots]
        self._mask = len(keys) - 1

    def longest(self, keys: Sequence[int]) -> int | None:
        if not keys:
            return None
        wanted = np.fromiter(keys, np.int64, len(keys))
        slots = wanted & self._mask
        found = np.flatnonzero(self._keys[slots] == wanted)
        return int(self._owners[slots[found[-1]]]) if found.size else None

    def claim(self, keys: Sequence[int], replica: int) -> None:
        if not keys:
            return
        wanted = np.fromiter(keys, np.int64, len(keys))
        slots = wanted & self._mask
        self._owners[slots] = replica  # owner first: a reader that finds the key finds its owner
        self._keys[slots] = wanted

    def __len__(self) -> int:
        return int(np.count_nonzero(self._keys))


class ReplicaRouter:
    """Picks a replica per request from its prompt and the replicas' current loads. `owners`: the
    prefix map (LocalPrefixOwners(max_keys) when None; SharedPrefixOwners across API servers);
    `first`: where ties start (API servers start at different replicas, so their ties spread too)."""

    def __init__(self, num_replicas: int, page_size: int, imbalance: int = 8, max_keys: int = 1 << 16,
                 owners: PrefixOwners | None = None, first: int = 0):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.imbalance = imbalance
        self.affinity_hits = 0  # requests sent where their prefix was
        self._owners = owners if owners is not None else LocalPrefixOwners(max_keys)
        self._next = first % num_replicas  # where the search for the least loaded starts: ties go round

    def route(self, token_ids: Sequence[int], loads: Sequence[int], salt: Hashable = ()) -> int:
        """The replica for a request with these prompt tokens; loads[r] is what replica r has in flight."""
        keys = prefix_keys(token_ids, self.page_size, salt)
        order = [(self._next + i) % self.num_replicas for i in range(self.num_replicas)]
        least = min(order, key=loads.__getitem__)
        replica = least
        owner = self._owners.longest(keys)  # the longest prefix a replica holds
        if owner is not None and 0 <= owner < self.num_replicas and loads[owner] <= loads[least] + self.imbalance:
            replica = owner
            self.affinity_hits += 1
        if replica == least:
            self._next = (least + 1) % self.num_replicas
        self._owners.claim(keys, replica)
        return replica

    @property
    def num_keys(self) -> int:
        """Prefix keys remembered (at most max_keys)."""
        return len(self._owners)
