"""The cache the selector opens: :func:`open_cache` (the local store, with a Redis tier behind it
when ``TE_FL_ATTN_REMOTE_CACHE`` names one: :class:`TieredCache`), :func:`default_cache` (the
process-wide one) and :func:`reset_default_cache`."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..reasons import ProbeResult
from ..switches import switch
from .keys import CacheKey, is_hex64
from .memory import MemoryCache
from .remote import RedisTier, remote_tier
from .rows import CacheRow, make_row
from .sqlite import ProbeCache

log = logging.getLogger("te_fl_attention.cache")


class TieredCache:
    """The local store first, then Redis: read through, write back to both.

    Reads and writes (:class:`~.interface.Store`) go to both tiers; the admin interface
    (:class:`~.interface.AdminStore`: stats, prune, clear, rows) is the local store's, named here
    one by one; ``remote`` is the :class:`RedisTier`.
    """

    def __init__(self, local: ProbeCache | MemoryCache, remote: RedisTier) -> None:
        self.local = local
        self.remote = remote

    def __repr__(self) -> str:
        return f"TieredCache({self.local!r}, {self.remote!r})"

    # ------------------------------------------------------------------ the local store's
    @property
    def path(self) -> Any:
        return getattr(self.local, "path", None)

    @property
    def mode(self) -> str:
        return getattr(self.local, "mode", "memory")

    def warm_up(self) -> None:
        self.local.warm_up()

    def load_slice(self, device_fp: str, versions_key: str, **limits: int
                   ) -> dict[tuple[str, str], tuple] | None:  # fmt: skip
        """The local store's slice (a key it lacks is then asked of both tiers by
        :meth:`get_many`)."""
        load = getattr(self.local, "load_slice", None)
        return load(device_fp, versions_key, **limits) if load is not None else None

    def decode_row(self, key: CacheKey, row: Any) -> ProbeResult | None:
        return self.local.decode_row(key, row)  # type: ignore[union-attr]

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        return self.local.get_rows(keys)

    def recent(self, limit: int, *, backend: str | None = None) -> list[CacheRow]:
        return self.local.recent(limit, backend=backend)

    def stats(self) -> dict[str, Any]:
        return self.local.stats()

    def prune(self, older_than_s: float | None = None,
              not_versions_key: str | Iterable[str] | None = None) -> int:  # fmt: skip
        return self.local.prune(older_than_s, not_versions_key)

    def clear(self) -> int:
        return self.local.clear()

    def __len__(self) -> int:
        return len(self.local)

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reads
    def get(self, key: CacheKey) -> ProbeResult | None:
        return self.get_many([key]).get(CacheKey(*key))

    def get_many(self, keys: Iterable[CacheKey]) -> dict[CacheKey, ProbeResult]:
        """Local hits, then one Redis round trip for the misses (its hits are stored locally)."""
        keys = [CacheKey(*k) for k in keys]
        out = self.local.get_many(keys)
        missing = [k for k in keys if k not in out]
        if missing and not self.remote.disabled:
            found = self.remote.get_many(missing)
            if found:
                self._write_back(found)
                out.update(found)
        return out

    def _write_back(self, found: Mapping[CacheKey, ProbeResult]) -> None:
        metas = self.remote.contexts({(k.device_fp, k.versions_key) for k in found})
        configs = self.remote.config_json(k.config_key for k in found)
        rows = []
        for k, result in found.items():
            meta = metas.get((k.device_fp, k.versions_key), {})
            rows.append(make_row(k, result, configs.get(k.config_key), meta.get("device")))
        self.local.put_many(rows, on_conflict="ignore", checked=True)

    def iter_rows(self, **filters: Any) -> Iterator[CacheRow]:
        """The local rows; for one exact ``config_prefix`` (a full config key) also the rows
        other machines stored in Redis for that config."""
        seen = set()
        for row in self.local.iter_rows(**filters):
            seen.add(row.key)
            yield row
        ck = filters.get("config_prefix")
        if ck and is_hex64(ck) and not self.remote.disabled:
            for row in self.remote.rows_for_config(ck):
                if row.key in seen:
                    continue
                if filters.get("backend") not in (None, row.key.backend):
                    continue
                if filters.get("device_fp") not in (None, row.key.device_fp):
                    continue
                yield row

    # ------------------------------------------------------------------ writes
    def put(self, key: CacheKey, result: ProbeResult, *, config: Any = None,
            device: Any = None) -> None:  # fmt: skip
        self.put_many([make_row(key, result, config, device)], checked=True)

    def put_many(self, items: Iterable[Any], *, on_conflict: str = "replace",
                 checked: bool = False) -> int:  # fmt: skip
        """Write to the local store, then to Redis (``ignore``: keep what Redis holds)."""
        rows = [make_row(*item) if not isinstance(item, CacheRow) else
                item if checked else dataclasses.replace(item, key=item.key.check())
                for item in items]  # fmt: skip
        n = self.local.put_many(rows, on_conflict=on_conflict, checked=True)  # type: ignore[arg-type]
        self.remote.put_many(rows, only_new=on_conflict == "ignore")
        return n

    def close(self) -> None:
        self.local.close()
        self.remote.close()


# ---------------------------------------------------------------------------- location / defaults
_OFF = {"off", "0", "none", "false", "no", "disabled"}


def default_path() -> Path:
    """``<user cache dir>/te_fl_attention/probes.sqlite`` (platformdirs)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("te_fl_attention")) / "probes.sqlite"


def open_cache(path: str | os.PathLike[str] | None = None) -> ProbeCache | MemoryCache:
    """Open the cache at ``path`` or where the environment says.

    ``TE_FL_ATTN_CACHE``: a file path, or ``off``/``0``/``none`` for no persistence (a
    :class:`MemoryCache`). ``TE_FL_ATTN_CACHE_READONLY=1`` opens the file read-only.
    An explicit ``path`` wins over ``TE_FL_ATTN_CACHE``.

    ``TE_FL_ATTN_REMOTE_CACHE=redis://host:port/db`` puts a shared Redis tier behind the local
    store (:class:`TieredCache`: same API, read through, write
    back to both; Redis trouble is a miss with one warning).
    """
    create_dir = False  # an explicit path's directory must exist; the default one is created
    if path is None:
        env = os.environ.get("TE_FL_ATTN_CACHE", "").strip()
        path = env or default_path()
        create_dir = not env
    local: ProbeCache | MemoryCache
    if str(path).strip().lower() in _OFF:
        local = MemoryCache()
    else:
        readonly = switch("TE_FL_ATTN_CACHE_READONLY")  # exactly 0/1; anything else raises
        if readonly:
            log.info("probe cache %s opened read-only (TE_FL_ATTN_CACHE_READONLY); new results "
                     "stay in memory", path)  # fmt: skip
        local = ProbeCache(path, readonly=readonly, create_dir=create_dir)
    url = os.environ.get("TE_FL_ATTN_REMOTE_CACHE", "").strip()
    if not url or url.lower() in _OFF:
        return local
    return TieredCache(local, remote_tier(url))  # type: ignore[return-value]


_default: ProbeCache | MemoryCache | None = None
_default_lock = threading.Lock()


def default_cache() -> ProbeCache | MemoryCache:
    """The process-wide cache (:func:`open_cache` with no path), created on first use."""
    global _default
    cache = _default
    if cache is None:
        with _default_lock:
            if _default is None:
                _default = open_cache()
            cache = _default
    return cache


def reset_default_cache() -> None:
    """Close and forget the process-wide cache (tests; after changing the environment)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = None
