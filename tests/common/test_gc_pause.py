"""common.gc_pause: the collector is off inside, and afterwards as it was before, whatever
happened inside; what was made inside is still collected afterwards."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from common.gc_pause import collector_paused


@pytest.fixture
def restore_collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("on_before", [True, False])
@pytest.mark.parametrize("raises", [False, True])
def test_the_collector_is_off_inside_and_as_before_afterwards(restore_collector, on_before, raises):
    (gc.enable if on_before else gc.disable)()
    inside = []
    with pytest.raises(KeyError) if raises else contextlib.nullcontext():
        with collector_paused():
            inside.append(gc.isenabled())
            if raises:
                raise KeyError("inside")
    assert inside == [False]
    assert gc.isenabled() is on_before


class _Node:
    pass


def test_a_cycle_made_inside_survives_allocations_inside_and_is_freed_afterwards(restore_collector):
    gc.enable()
    with collector_paused():
        a, b = _Node(), _Node()
        a.other, b.other = b, a          # a cycle: only the collector frees it
        ref = weakref.ref(a)
        del a, b
        junk = [[i] for i in range(50_000)]   # far past gen 0's threshold: no collection runs
        assert ref() is not None
        del junk
    gc.collect()
    assert ref() is None
