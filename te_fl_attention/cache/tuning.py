"""Tuned Triton tiles kept in the probe cache, so a warm job never autotunes.

:class:`ProbeCacheTuningStore` is a :class:`~te_fl_attention.kernels.tuning.TuningStore` over the
SQLite probe cache (:func:`~te_fl_attention.cache.tiered.default_cache` unless given one). One
choice is one row:

* ``CacheKey(config_key=sha256(TuneKey.canonical()), backend="triton",
  device_fp=<the tuned device's fingerprint>, versions_key=versions_key(device,
  probe_env={"stage": "tune", "code": <kernel source + Triton version digest>}))``;
* the value is a :class:`~te_fl_attention.reasons.ProbeResult` (``backend="triton"``,
  ``stage="measure"``, ``evidence="tuned m128n64w8s3"``) whose ``detail`` holds
  ``{"kind": "triton_tune", "key": <the TuneKey>, "choice": {"config": ..., "times_ms": ...}}``.

A row whose detail is not such a record, or whose key is not the one asked for, reads as a miss;
the tuner also checks the stored config against the configs it keeps before using it.
:func:`install` makes the probe cache the kernels' store (idempotent, cheap: the file is opened
at the first tuned launch).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..kernels import tuning
from ..reasons import ProbeResult
from .keys import CacheKey, versions_key

if TYPE_CHECKING:
    from ..device import DeviceProfile
    from .memory import MemoryCache
    from .sqlite import ProbeCache

log = logging.getLogger("te_fl_attention.cache")

__all__ = ["KIND", "ProbeCacheTuningStore", "cache_key", "install", "uninstall"]

#: ``detail["kind"]`` of a tuning row.
KIND = "triton_tune"
BACKEND = "triton"


def device_profile(key: tuning.TuneKey) -> DeviceProfile:
    """The tuned device as a :class:`~te_fl_attention.device.DeviceProfile`: its hardware from
    the key, the software stack of this machine."""
    from ..device import DeviceProfile, local

    return DeviceProfile(name=key.device, sm=key.sm, sm_count=key.sm_count,
                         memory_gib=key.memory_gib, **local().versions())  # fmt: skip


def cache_key(key: tuning.TuneKey, device: DeviceProfile | None = None) -> CacheKey:
    """The probe-cache key of ``key``'s choice (see the module docstring)."""
    device = device_profile(key) if device is None else device
    env = {"stage": "tune", "code": key.code}
    vkey = versions_key(device, probe_env=env)
    return CacheKey(key.digest(), BACKEND, device.fingerprint(), vkey)


class ProbeCacheTuningStore:
    """Tile choices as probe-cache rows (``cache``: a store; ``None``: the default cache)."""

    def __init__(self, cache: ProbeCache | MemoryCache | None = None) -> None:
        self._cache = cache
        self._devices: dict[tuple[str, int, int, float], DeviceProfile] = {}

    def __repr__(self) -> str:
        return f"ProbeCacheTuningStore({self.cache!r})"

    @property
    def cache(self) -> ProbeCache | MemoryCache:
        if self._cache is None:
            from .tiered import default_cache

            return default_cache()
        return self._cache

    def _key(self, key: tuning.TuneKey) -> tuple[CacheKey, DeviceProfile]:
        hw = (key.device, key.sm, key.sm_count, key.memory_gib)
        device = self._devices.get(hw)
        if device is None:
            device = self._devices[hw] = device_profile(key)
        return cache_key(key, device), device

    def get(self, key: tuning.TuneKey) -> Mapping[str, Any] | None:
        ck, _ = self._key(key)
        hit = self.cache.get_many([ck]).get(ck)
        if hit is None:
            return None
        detail = hit.detail
        if (hit.backend != BACKEND or detail.get("kind") != KIND
                or detail.get("key") != key.to_dict()):  # fmt: skip
            return None
        choice = detail.get("choice")
        return choice if isinstance(choice, Mapping) else None

    def put(self, key: tuning.TuneKey, choice: Mapping[str, Any]) -> None:
        ck, device = self._key(key)
        cfg = tuning.Config.from_dict(choice.get("config"))
        times = choice.get("times_ms") or {}
        total = sum(t for t in times.values() if isinstance(t, (int, float)))
        result = ProbeResult(
            backend=BACKEND, supported=True, stage="measure",
            evidence=f"tuned {cfg.name if cfg else '?'}", elapsed_ms=float(total),
            detail={"kind": KIND, "key": key.to_dict(), "choice": dict(choice)},
        )  # fmt: skip
        self.cache.put_many([(ck, result, None, device)])


def install(cache: ProbeCache | MemoryCache | None = None) -> ProbeCacheTuningStore:
    """Keep the Triton kernels' tuned tiles in the probe cache (``cache``; ``None``: the default
    cache, opened on first use). Idempotent; returns the store in use."""
    current = tuning.get_store()
    if isinstance(current, ProbeCacheTuningStore) and current._cache is cache:
        return current
    store = ProbeCacheTuningStore(cache)
    tuning.set_store(store)
    return store


def uninstall() -> None:
    """Back to the in-memory store."""
    tuning.set_store(None)
