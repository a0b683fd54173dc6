"""The two interfaces of a probe cache: the small one the selector uses, and the admin one the
``te-fl-attn cache`` commands, fleet planning and transfers use. :class:`ProbeCache`,
:class:`MemoryCache` and :class:`TieredCache` implement both."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from ..reasons import ProbeResult
from .keys import CacheKey
from .rows import CacheRow


@runtime_checkable
class Store(Protocol):
    """What the selector needs: batched reads and writes (failures are misses, never raise).
    Used when a store has them: ``warm_up()`` (ready the lookups before the first one), and
    ``load_slice(device_fp, versions_key)`` + ``decode_row(key, row)`` (a job's rows for
    one device and software stack in one query, decoded on first use; a row that is already a
    :class:`ProbeResult` is taken as it is, and ``decode_row`` is called for the others)."""

    def get_many(self, keys: Iterable[CacheKey]) -> dict[CacheKey, ProbeResult]: ...

    def put_many(self, items: Iterable[Any]) -> int: ...

    def __len__(self) -> int: ...


@runtime_checkable
class AdminStore(Store, Protocol):
    """Everything else: single reads and writes, iteration, statistics, pruning, clearing."""

    def warm_up(self) -> None: ...

    def get(self, key: CacheKey) -> ProbeResult | None: ...

    def put(self, key: CacheKey, result: ProbeResult, *, config: Any = None,
            device: Any = None) -> None: ...  # fmt: skip

    def iter_rows(self, **filters: Any) -> Iterator[CacheRow]: ...

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]: ...

    def recent(self, limit: int, *, backend: str | None = None) -> list[CacheRow]: ...

    def stats(self) -> dict[str, Any]: ...

    def prune(self, older_than_s: float | None = None,
              not_versions_key: str | Iterable[str] | None = None) -> int: ...  # fmt: skip

    def clear(self) -> int: ...

    def close(self) -> None: ...


__all__ = ["Store", "AdminStore"]
