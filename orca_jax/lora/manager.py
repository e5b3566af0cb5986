"""The engine's LoRA adapters: the registry, the host-memory cache and the device slots (no jax).

Adapters are registered by name and lora_int_id (LoRARequest) and read from disk once, checked
against the base model (adapter.py). Their weights stay in host memory while a request needs them or
a device slot holds them, plus up to max_cpu_loras others, least recently used first out (read from
disk again if asked for later). Which adapter sits in which device slot is slots.py's; the engine
uploads what it says before dispatching a plan, through `upload` (the runner's load_lora).
"""

from __future__ import annotations

import collections
import itertools
import os
from typing import Callable

from orca_jax.config import LoRAConfig, ModelConfig
from orca_jax.lora.adapter import CONFIG_FILE, LoRAAdapter, LoRAError, check_finite, load_adapter
from orca_jax.lora.request import LoRARequest
from orca_jax.lora.slots import AdapterSlots

# upload(slot, adapter): write the adapter into device slot `slot` (1-based).
Upload = Callable[[int, LoRAAdapter], None]


class LoRAManager:
    """Registered adapters, their host copies and their device slots."""

    def __init__(self, config: LoRAConfig, model: ModelConfig, upload: Upload):
        self.config = config
        self.model = model  # the base model's own shapes, which adapters are checked against
        self.slots = AdapterSlots(config.max_loras)
        self._upload = upload
        self._registered: dict[int, LoRARequest] = {}  # by lora_int_id
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()  # LRU last
        self._requests: dict[str, int] = {}  # unfinished request id -> its adapter's lora_int_id
        # Ids of removed adapters are never taken again: they salt the prefix cache, whose pages may
        # outlive the adapter, and a request racing its adapter's removal must not bring it back.
        self._removed: set[int] = set()
        self._unreadable: set[int] = set()  # handed over in memory with no adapter at their path: always kept
        self._ids = itertools.count(1)  # new_id's candidates
        self.num_loads = 0  # adapters written into a device slot, since start

    # ---- the registry ----------------------------------------------------------------------------
    def add(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Register an adapter (read from lora.lora_path unless given; one given whose path holds no
        adapter, e.g. random weights, stays in host memory); LoRAError if it cannot be served (a weight
        not finite among them: one slot's NaN would reach every token of a batch that reads the table
        densely) or its name or id is taken by another. Registering the same one again is a no-op."""
        known = self._registered.get(lora.lora_int_id)
        if known == lora:
            return
        if lora.lora_int_id in self._removed:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} belonged to an "
                            "adapter that was unloaded; give a new adapter a new id")
        if known is not None:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} is already used "
                            f"by adapter {known.lora_name!r} ({known.lora_path})")
        if any(r.lora_name == lora.lora_name for r in self._registered.values()):
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} is already loaded")
        if adapter is not None:  # one read from its path was checked there
            check_finite(adapter)
        self._host[lora.lora_int_id] = adapter or self._read(lora)
        if adapter is not None and not os.path.isfile(os.path.join(lora.lora_path, CONFIG_FILE)):
            self._unreadable.add(lora.lora_int_id)
        self._registered[lora.lora_int_id] = lora
        self._trim_host()

    def remove(self, lora_int_id: int) -> bool:
        """Unregister an adapter; requests already using it finish with it. False if unknown."""
        if self._registered.pop(lora_int_id, None) is None:
            return False
        self._removed.add(lora_int_id)
        self._unreadable.discard(lora_int_id)
        self.slots.remove(lora_int_id)
        self._trim_host()
        return True

    def new_id(self) -> int:
        """A lora_int_id no adapter has had: for adapters named by the server or made by fine-tuning
        (any thread: the server takes them on its event loop, fine-tuning on the engine thread)."""
        while True:
            candidate = next(self._ids)  # atomic under the GIL
            if candidate not in self._registered and candidate not in self._removed:
                return candidate

    def list(self) -> list[LoRARequest]:
        """The registered adapters, in order of registration."""
        return list(self._registered.values())

    # ---- requests --------------------------------------------------------------------------------
    def request_added(self, request_id: str, lora: LoRARequest) -> int:
        """A request will run with `lora` (registered now if new): its lora_int_id. Its weights stay in
        host memory until request_done."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        self.add(lora)
        if lora.lora_int_id not in self._host:  # evicted from host memory since: read it again
            self._host[lora.lora_int_id] = self._read(lora)
        self._host.move_to_end(lora.lora_int_id)
        self._requests[request_id] = lora.lora_int_id
        return lora.lora_int_id

    def request_done(self, request_id: str) -> None:
        """The request finished or was aborted (a no-op for one without an adapter)."""
        if self._requests.pop(request_id, None) is not None:
            self._trim_host()

    def upload_loads(self) -> None:
        """Write into their slots the adapters the last plan placed there (before its dispatch)."""
        for slot, lora_int_id in self.slots.take_loads():
            self._upload(slot, self._host[lora_int_id])
            self.num_loads += 1

    # ---- inside ----------------------------------------------------------------------------------
    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        return load_adapter(lora.lora_path, lora.lora_name, self.model, self.config.max_lora_rank)

    def _trim_host(self) -> None:
        """Drop host copies nobody needs: unregistered ones at once, beyond max_cpu_loras the least
        recently used."""
        needed = set(self._requests.values()) | set(self.slots.resident) | self._unreadable
        idle = [i for i in self._host if i not in needed]
        excess = len([i for i in idle if i in self._registered]) - self.config.num_cpu_loras
        for lora_int_id in idle:
            if lora_int_id not in self._registered:
                del self._host[lora_int_id]
            elif excess > 0:
                del self._host[lora_int_id]
                excess -= 1
