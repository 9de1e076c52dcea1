"""The KV memory core: page pools, the radix prefix cache, request page tables and the audit.

Ownership is by reference count (DESIGN.md §3); `KVManager` (manager.py) is the API the engine
calls. This package imports no torch except in tensors.py (the physical K/V), which it does not
import here.
"""

from freetoken.kv.errors import IntegrityReport, KVIntegrityError
from freetoken.kv.manager import KVManager
from freetoken.kv.window import swa_floor

__all__ = ["IntegrityReport", "KVIntegrityError", "KVManager", "swa_floor"]
