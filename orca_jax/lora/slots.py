"""Which LoRA adapter holds each device slot, and who may take one (host only; no jax).

The scheduler makes two calls: `admit(request)` when a waiting request's KV would fit (True: the
request's adapter has a slot, now pinned by the request; False: it waits, and the scheduler goes on
with the requests behind it; a request whose KV cannot fit takes no slot, so it evicts nothing), and
`release(request)` when the request gives its KV up (finished, preempted, or not admitted after all). The engine then takes the slots to load before it
dispatches the plan (`take_loads`).

- A slot pinned by a request holding KV is never evicted (its batches read the slot).
- An adapter with no slot takes a free one: empty, else the least recently used unpinned one.
- No starvation: when adapters waited for a slot in a plan and none was free, as many pinned slots
  (least recently used first) are drained: no new request pins them, so once their running requests
  finish, a waiting adapter takes them. Running requests always finish, so nothing deadlocks.
Slots are numbered 1..num_slots, as a batch's lora_slots names them (0: no adapter).
"""

from __future__ import annotations

import dataclasses
import itertools

from orca_jax.core.request import Request


@dataclasses.dataclass(slots=True)
class _Slot:
    lora_int_id: int = 0  # 0: empty
    pins: int = 0  # requests holding KV that use it
    last_used: int = 0  # tick of the last pin, for least-recently-used eviction
    draining: bool = False  # no new pins: a waiting adapter takes it once unpinned


class AdapterSlots:
    """The device's adapter slots, seen from the host."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self._slots = [_Slot() for _ in range(num_slots + 1)]  # [0] unused: slot 0 means none
        self._slot_of: dict[int, int] = {}  # lora_int_id -> its slot
        self._retired: set[int] = set()  # adapters removed while pinned: freed once unpinned
        self._waiting: list[int] = []  # adapters refused in the current plan, in the plan's order
        self._loads: list[tuple[int, int]] = []  # (slot, lora_int_id) to upload before the next dispatch
        self._tick = itertools.count(1)

    @property
    def num_slots(self) -> int:
        return len(self._slots) - 1

    def slot_of(self, lora_int_id: int) -> int:
        """The slot holding the adapter, or 0."""
        return self._slot_of.get(lora_int_id, 0)

    def pins(self, slot: int) -> int:
        """Requests holding KV that use `slot`."""
        return self._slots[slot].pins

    @property
    def resident(self) -> dict[int, int]:
        """lora_int_id -> slot, for every adapter on the device."""
        return dict(self._slot_of)

    # ---- the scheduler's two calls -----------------------------------------------------------------
    def admit(self, request: Request) -> bool:
        """Pin a slot holding the request's adapter (loading it into a free one if needed) and set
        request.lora_slot; False: no slot can be had now, the request waits."""
        lora_int_id = request.lora_int_id
        if lora_int_id == 0 or request.lora_slot:
            return True
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            if self._waiting and self._waiting[0] != lora_int_id:  # an adapter ahead of it waits too
                slot = None
            else:
                slot = self._take_free_slot(lora_int_id)
            if slot is None:
                if lora_int_id not in self._waiting:
                    self._waiting.append(lora_int_id)
                return False
        elif self._slots[slot].draining:
            return False  # it goes to a waiting adapter once its requests finish
        if lora_int_id in self._waiting:
            self._waiting.remove(lora_int_id)
        state = self._slots[slot]
        state.pins += 1
        state.last_used = next(self._tick)
        request.lora_slot = slot
        return True

    def release(self, request: Request) -> None:
        """The request gives up its slot (it stays loaded, evictable once no request pins it)."""
        slot, request.lora_slot = request.lora_slot, 0
        if not slot:
            return
        state = self._slots[slot]
        state.pins -= 1
        if state.pins == 0 and state.lora_int_id in self._retired:
            self._free(slot)

    # ---- the engine's -------------------------------------------------------------------------------
    def take_loads(self) -> list[tuple[int, int]]:
        """The plan is final: (slot, lora_int_id) to upload before its dispatch. Also decides which
        slots drain for the adapters that waited in this plan."""
        loads, self._loads = self._loads, []
        free = sum(1 for s in self._slots[1:] if s.pins == 0)
        wanted = min(len(self._waiting), self.num_slots) - free
        pinned = sorted((s for s in self._slots[1:] if s.pins), key=lambda s: (not s.draining, s.last_used))
        for i, state in enumerate(pinned):
            state.draining = i < wanted
        for state in self._slots[1:]:
            if state.pins == 0:
                state.draining = False
        self._waiting = []
        return [(slot, lora_int_id) for slot, lora_int_id in loads if self._slots[slot].lora_int_id == lora_int_id]

    def remove(self, lora_int_id: int) -> None:
        """The adapter is unloaded: its slot is freed now, or once the requests using it finish."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            return
        if self._slots[slot].pins:
            self._retired.add(lora_int_id)
        else:
            self._free(slot)

    # ---- inside ---------------------------------------------------------------------------------------
    def _take_free_slot(self, lora_int_id: int) -> int | None:
        """An unpinned slot for the adapter (empty first, then draining, then least recently used),
        its old adapter evicted; None if every slot is pinned."""
        candidates = [i for i, s in enumerate(self._slots) if i and s.pins == 0]
        if not candidates:
            return None
        slot = min(candidates, key=lambda i: (self._slots[i].lora_int_id != 0, not self._slots[i].draining,
                                              self._slots[i].last_used))
        if self._slots[slot].lora_int_id:
            self._free(slot)
        self._slots[slot].lora_int_id = lora_int_id
        self._slot_of[lora_int_id] = slot
        self._loads.append((slot, lora_int_id))
        return slot

    def _free(self, slot: int) -> None:
        state = self._slots[slot]
        self._slot_of.pop(state.lora_int_id, None)
        self._retired.discard(state.lora_int_id)
        self._slots[slot] = _Slot(last_used=state.last_used)
