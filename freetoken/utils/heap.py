"""The long-lived heap of a serving process: what it builds at startup (modules, the model's
Python objects, the tokenizer, compiled templates and schemas) is frozen out of the cyclic
garbage collector, so a full collection while serving scans only what serving made; and the
memory the load freed is handed back to the operating system.

Without it a full collection walks every object the process ever created: ~190k objects in the
engine process after loading Gemma 3, where one full pass cost 95 ms of CPU on a busy 2-core
machine, and one such pass in the API process stalled a token stream by half a second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def freeze_startup_heap() -> None:
    """Collect what startup left as garbage, then move every surviving object to the
    collector's permanent generation (never scanned again; still freed by reference counting)."""
    gc.collect()
    gc.freeze()


def return_freed_memory() -> None:
    """Give the C allocator's free memory back to the system (glibc's malloc_trim; a no-op
    elsewhere). A model load frees as much as it keeps (each matrix's integer temporaries), and
    glibc keeps freed heap memory for reuse: after loading a 725 MB Q4_K_M file the engine held
    2.16 GB of anonymous memory, 0.89 GB once trimmed."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
