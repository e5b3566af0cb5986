"""The serving process's garbage-collection and GIL settings (orca_jax.server.gc_and_gil)."""

import gc
import sys

from orca_jax.server import gc_and_gil


def test_gil_switch_interval_is_shortened():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # CPython's default, whatever ran in this process before
        gc_and_gil.shorten_gil_switch_interval()
        assert sys.getswitchinterval() == gc_and_gil.GIL_SWITCH_INTERVAL_SECONDS < 0.005
    finally:
        sys.setswitchinterval(before)


def test_freezing_keeps_live_objects_out_of_collections_and_collects_garbage_first():
    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # garbage only a collection frees
    collected = []
    garbage = Node()
    garbage.self = garbage
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    del garbage
    try:
        gc_and_gil.freeze_startup_heap()
        assert sum(collected) >= 1  # the cycle dropped before the freeze was collected, not frozen
        assert gc.get_freeze_count() > 0
        assert all(cycle is not obj for obj in gc.get_objects())  # frozen: out of the collector's sight
    finally:
        gc.callbacks.pop()
        gc.unfreeze()
