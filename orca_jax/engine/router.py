"""Which data-parallel replica takes a request: the one holding its prompt's prefix, else the least loaded.

Replicas are whole engines, each on its own devices with its own KV pool and prefix cache, so a
conversation's next turn is cheap only on the replica that served the last one. The router keeps a
bounded map from prompt-prefix keys to the replica that last took them: keys of every full page of
the prompt, chained as the prefix cache chains them (core/kv/prefix_index.py: a page's key covers
every token before it and the request's KV salt), so the longest known prefix wins. Affinity yields to
load: a replica more than `imbalance` requests busier than the least loaded one is passed over (a
hot conversation must not pile every request onto one replica).

Host only, no jax: the front end routes before any engine sees the request.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Hashable, Sequence

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


def adapter_salt(lora_request: LoRARequest | None) -> tuple:
    """route()'s salt for a request: its adapter's name (an adapter's KV differs from the base model's)."""
    return () if lora_request is None else (lora_request.lora_name,)


class ReplicaRouter:
    """Picks a replica per request from its prompt and the replicas' current loads."""

    def __init__(self, num_replicas: int, page_size: int, imbalance: int = 8, max_keys: int = 1 << 16):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.imbalance = imbalance
        self.max_keys = max_keys
        self.affinity_hits = 0  # requests sent where their prefix was
        self._owner: collections.OrderedDict[int, int] = collections.OrderedDict()  # key -> replica, LRU
        self._next = 0  # where the search for the least loaded starts: ties go round, not to replica 0

    def route(self, token_ids: Sequence[int], loads: Sequence[int], salt: Hashable = ()) -> int:
        """The replica for a request with these prompt tokens; loads[r] is what replica r has in flight."""
        keys = prefix_keys(token_ids, self.page_size, salt)
        order = [(self._next + i) % self.num_replicas for i in range(self.num_replicas)]
        least = min(order, key=loads.__getitem__)
        replica = least
        for key in reversed(keys):  # the longest prefix a replica holds
            owner = self._owner.get(key)
            if owner is not None:
                if loads[owner] <= loads[least] + self.imbalance:
                    replica = owner
                    self.affinity_hits += 1
                break
        if replica == least:
            self._next = (least + 1) % self.num_replicas
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)
        return replica

    @property
    def num_keys(self) -> int:
        """Prefix keys remembered (at most max_keys)."""
        return len(self._owner)
