"""The cyclic collector around planning (autopar/planning/collector.py): paused for a planning call, running
around its captures with the heap from before the capture frozen, and everything as it was afterwards."""
from __future__ import annotations

import gc
import weakref

from autopar.planning import collector


class _Node:
    def __init__(self):
        self.other = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_capture_inside_a_paused_call_collects_its_own_cycles_with_the_older_heap_frozen():
    was = gc.isenabled()
    try:
        gc.enable()
        with collector.paused():
            assert not gc.isenabled()
            older = _cycle()   # planning's garbage: left to the collector after the call
            with collector.running():
                assert gc.isenabled() and gc.get_freeze_count() > 0   # what lived before is out of the passes
                mine = _cycle()
                gc.collect()
                assert mine() is None   # the capture's cyclic garbage goes
                assert older() is not None   # the frozen heap is not walked
            assert not gc.isenabled() and gc.get_freeze_count() == 0
        assert gc.isenabled()
        gc.collect()
        assert older() is None
    finally:
        (gc.enable if was else gc.disable)()


def test_a_callers_own_freeze_is_left_as_it_was():
    was = gc.isenabled()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector.paused(), collector.running():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()
