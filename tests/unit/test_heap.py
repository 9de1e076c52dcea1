"""freeze_startup_heap: what exists at startup leaves the collector's generations (a full
collection no longer walks it) and garbage made before it is gone."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import gc, weakref
from freetoken.utils.heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]           # startup state that lives on
cycle = Node(); cycle.me = cycle                # startup garbage: only the collector frees a cycle
dead = weakref.ref(cycle); del cycle
freeze_startup_heap()
assert dead() is None, "startup garbage survived the freeze"
tracked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
assert not any(id(k) in tracked for k in kept), "startup objects are still scanned"
assert gc.get_freeze_count() >= len(kept)
later = Node()
assert any(o is later for o in gc.get_objects(generation=0)), "new objects are collected as usual"
"""


def test_startup_objects_leave_the_collector_and_startup_garbage_is_freed() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
