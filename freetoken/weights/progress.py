"""The weight loaders' progress callback type: one call after each tensor read, with (tensors
read, tensors in the checkpoint, bytes of tensor data read, bytes of tensor data in all). A load
from the weight cache reads no tensor by itself: it counts the bytes of the entry it checks, with
0 for both tensor counts (weights/weight_cache.py). `ft serve`'s loading bar is drawn from it
(server/process/heartbeat.py carries the count to the API process, server/console.py draws it)."""

from __future__ import annotations

from collections.abc import Callable

ProgressCallback = Callable[[int, int, int, int], None]
