"""The disk tier's metric families (`--kv-disk-dir`), read from the `disk` section of the engine
status (kv/disk_tier.py `DiskTier.status`).

Owns `freetoken_kv_disk_bytes`, `freetoken_kv_disk_entries` (what is on disk now),
`freetoken_kv_disk_write_backlog` (pages copied and waiting for the writer), and the engine's
running totals since it started, exported as gauges since the status document carries totals:
`freetoken_kv_disk_hits` (admissions whose hit a load extended), `freetoken_kv_disk_loaded_pages`,
`freetoken_kv_disk_loaded_tokens`, `freetoken_kv_disk_load_seconds`, `freetoken_kv_disk_writes`,
`freetoken_kv_disk_dropped_writes`, `freetoken_kv_disk_corrupt`. All stay 0 without the tier.
It does not talk to the engine.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

FAMILIES = {  # status field -> (metric name, help)
    "bytes": ("freetoken_kv_disk_bytes", "Bytes of KV pages in the disk tier"),
    "entries": ("freetoken_kv_disk_entries", "KV pages in the disk tier"),
    "write_backlog": ("freetoken_kv_disk_write_backlog", "KV pages copied and waiting for the disk writer"),
    "hits": ("freetoken_kv_disk_hits", "Admissions whose prefix hit a disk load extended (total)"),
    "loaded_pages": ("freetoken_kv_disk_loaded_pages", "KV pages loaded from the disk tier (total)"),
    "loaded_tokens": ("freetoken_kv_disk_loaded_tokens", "Prompt tokens disk loads let requests skip (total)"),
    "load_seconds": ("freetoken_kv_disk_load_seconds", "Seconds spent loading KV pages from disk (total)"),
    "writes": ("freetoken_kv_disk_writes", "KV pages written to the disk tier (total)"),
    "dropped_writes": ("freetoken_kv_disk_dropped_writes", "KV pages not written: the write backlog was full"),
    "corrupt": ("freetoken_kv_disk_corrupt", "Disk tier files found unusable and dropped (total)"),
}


class DiskMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauges = {field: Gauge(name, text, registry=registry) for field, (name, text) in FAMILIES.items()}

    def update(self, status: dict[str, Any]) -> None:
        disk = status.get("disk") or {}
        for field, gauge in self.gauges.items():
            gauge.set(disk.get(field, 0))
