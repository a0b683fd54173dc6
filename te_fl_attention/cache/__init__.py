"""Persistent probe cache: `ProbeCache` (SQLite), `MemoryCache`, keys, export/import.

Importing this package is cheap (stdlib only; no torch, no rich).
"""

from __future__ import annotations

from .keys import PROBE_SCHEMA, CacheKey, package_version, versions_key
from .memory import MemoryCache
from .rows import CacheRow
from .sqlite import ProbeCache
from .tiered import default_cache, default_path, open_cache, reset_default_cache
from .transfer import ImportReport, MergeReport, export, import_, merge, warm_from

__all__ = [
    "PROBE_SCHEMA",
    "CacheKey",
    "CacheRow",
    "ImportReport",
    "MemoryCache",
    "MergeReport",
    "ProbeCache",
    "default_cache",
    "default_path",
    "export",
    "import_",
    "merge",
    "open_cache",
    "package_version",
    "reset_default_cache",
    "versions_key",
    "warm_from",
]
