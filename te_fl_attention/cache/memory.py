"""In-process stores: :class:`BaseCache` (the part every store shares: the memo, ``put``,
``get_row``...) and :class:`MemoryCache` (``TE_FL_ATTN_CACHE=off``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..reasons import ProbeResult
from .keys import CacheKey
from .rows import FUTURE_SKEW_S, CacheRow, OnConflict, PutItem, make_row, to_row

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

_T = TypeVar("_T")


def keep_set(keys: str | Iterable[str] | None) -> frozenset[str] | None:
    if keys is None:
        return None
    return frozenset([keys] if isinstance(keys, str) else keys)


# ------------------------------------------------------------------------------------ base class
class BaseCache:
    """What :class:`ProbeCache` and :class:`MemoryCache` share (the in-process part)."""

    path: Path | None = None

    def __init__(self) -> None:
        self._memo: dict[CacheKey, tuple[CacheRow, ProbeResult]] = {}
        self._configs: dict[str, Mapping[str, Any]] = {}  # config JSON, once per config key
        self._devices: dict[tuple[str, str], Mapping[str, Any]] = {}  # device JSON per context
        self._lock = threading.RLock()

    # memo helpers
    def _memo_put(self, row: CacheRow, on_conflict: OnConflict = "replace") -> bool:
        old = self._memo.get(row.key)
        if old is not None and (
            on_conflict == "ignore"
            or (on_conflict == "newer" and row.created_at <= old[0].created_at)
        ):
            return False
        self._memo[row.key] = (row, ProbeResult.from_dict(row.result))
        if row.config is not None:
            self._configs.setdefault(row.key.config_key, row.config)
        if row.device is not None:
            self._devices.setdefault((row.key.device_fp, row.key.versions_key), row.device)
        return True

    def _memo_row(self, row: CacheRow) -> CacheRow:
        """A memo row with the config/device JSON filled in from other rows (as SQLite does)."""
        if row.config is None or row.device is None:
            config = row.config or self._configs.get(row.key.config_key)
            device = row.device or self._devices.get((row.key.device_fp, row.key.versions_key))
            if config is not row.config or device is not row.device:
                return dataclasses.replace(row, config=config, device=device)
        return row

    def _memo_prune(self, older_than_s: float | None, keep: frozenset[str] | None) -> int:
        cutoff = time.time() - older_than_s if older_than_s is not None else None
        future = time.time() + FUTURE_SKEW_S
        doomed = [
            k for k, (row, _) in self._memo.items()
            if (cutoff is not None and not cutoff <= row.created_at <= future)
            or (keep is not None and k.versions_key not in keep)
        ]  # fmt: skip
        for k in doomed:
            del self._memo[k]
        return len(doomed)

    @staticmethod
    def _tally(rows: Iterable[CacheRow]) -> dict[str, Any]:
        by_backend: Counter[str] = Counter()
        by_device: Counter[str] = Counter()
        by_versions: Counter[str] = Counter()
        by_verdict: Counter[str] = Counter()
        names: dict[str, str] = {}
        for row in rows:
            by_backend[row.key.backend] += 1
            by_device[row.key.device_fp] += 1
            by_versions[row.key.versions_key] += 1
            by_verdict["supported" if row.result.get("supported") else "unsupported"] += 1
            if row.device and isinstance(row.device.get("name"), str):
                names[row.key.device_fp] = row.device["name"]
        return {
            "entries": sum(by_backend.values()),
            "by_backend": dict(by_backend),
            "by_device": dict(by_device),
            "device_names": names,
            "by_versions_key": dict(by_versions),
            "by_verdict": {
                "supported": by_verdict["supported"],
                "unsupported": by_verdict["unsupported"],
            },  # fmt: skip
        }

    # public API shared by both
    def put(
        self,
        key: CacheKey,
        result: ProbeResult,
        *,
        config: FusedAttnConfig | Mapping[str, Any] | None = None,
        device: DeviceProfile | Mapping[str, Any] | None = None,
    ) -> None:
        """Store ``result`` under ``key`` (replacing a row with the same key)."""
        self.put_many([make_row(key, result, config, device)], checked=True)

    def put_many(
        self, items: Iterable[PutItem], *, on_conflict: OnConflict = "replace",
        checked: bool = False,
    ) -> int:  # fmt: skip
        raise NotImplementedError

    def get_many(self, keys: Iterable[CacheKey]) -> dict[CacheKey, ProbeResult]:
        """The hits among ``keys`` (misses are absent)."""
        out: dict[CacheKey, ProbeResult] = {}
        for key in keys:
            hit = self.get(key)
            if hit is not None:
                out[CacheKey(*key)] = hit
        return out

    def get(self, key: CacheKey) -> ProbeResult | None:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Start-up work for lookups (nothing to do in memory; see :meth:`ProbeCache.warm_up`)."""

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        raise NotImplementedError

    def get_row(self, key: CacheKey) -> CacheRow | None:
        """The stored row for ``key`` with its bookkeeping (``created_at``...), or ``None``."""
        return self.get_rows([key]).get(CacheKey(*key))

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


class MemoryCache(BaseCache):
    """The same API as :class:`ProbeCache`, in process memory only (``TE_FL_ATTN_CACHE=off``)."""

    mode = "memory"

    def __repr__(self) -> str:
        return f"MemoryCache({len(self)} entries)"

    def get(self, key: CacheKey) -> ProbeResult | None:
        hit = self._memo.get(key)
        return hit[1] if hit else None

    def put_many(
        self, items: Iterable[PutItem], *, on_conflict: OnConflict = "replace",
        checked: bool = False,
    ) -> int:  # fmt: skip
        """Store many rows; returns how many were written (see :meth:`ProbeCache.put_many`)."""
        with self._lock:
            return sum(self._memo_put(to_row(item, checked), on_conflict) for item in items)

    def __len__(self) -> int:
        return len(self._memo)

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        """The stored rows (with bookkeeping) among ``keys``."""
        out = {}
        for k in keys:
            hit = self._memo.get(CacheKey(*k))
            if hit is not None:
                out[hit[0].key] = self._memo_row(hit[0])
        return out

    def iter_rows(
        self,
        *,
        backend: str | None = None,
        config_prefix: str | None = None,
        device_fp: str | None = None,
    ) -> Iterator[CacheRow]:
        """Every row (optionally filtered), in key order."""
        with self._lock:
            rows = [self._memo_row(row) for row, _ in self._memo.values()]
        for row in sorted(rows, key=lambda r: r.key):
            if backend is not None and row.key.backend != backend:
                continue
            if config_prefix is not None and not row.key.config_key.startswith(config_prefix):
                continue
            if device_fp is not None and row.key.device_fp != device_fp:
                continue
            yield row

    def recent(self, limit: int, *, backend: str | None = None) -> list[CacheRow]:
        """The ``limit`` most recently stored rows (``limit <= 0``: all), newest first."""
        rows = sorted(self.iter_rows(backend=backend), key=lambda r: r.created_at, reverse=True)
        return rows[:limit] if limit > 0 else rows

    def stats(self) -> dict[str, Any]:
        """Counts by backend, device, software stack and verdict."""
        return {"path": None, "mode": self.mode, "size_bytes": 0,
                **self._tally(self.iter_rows())}  # fmt: skip

    def prune(self, older_than_s: float | None = None,
              not_versions_key: str | Iterable[str] | None = None) -> int:  # fmt: skip
        """Drop rows older than ``older_than_s`` and/or from another software stack."""
        with self._lock:
            return self._memo_prune(older_than_s, keep_set(not_versions_key))

    def clear(self) -> int:
        """Drop every row; returns how many."""
        with self._lock:
            n = len(self._memo)
            self._memo.clear()
            self._configs.clear()
            return n

    def close(self) -> None:
        """Nothing to release (kept for API symmetry)."""

