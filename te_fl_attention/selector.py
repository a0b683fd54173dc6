"""`Selector`: memo -> probe cache -> probes -> policy -> `Decision`.

The hot path is a dict lookup keyed on the frozen (config, device, policy) triple: no I/O, no
hashing beyond the dataclasses' own ``__hash__``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

from .config import FusedAttnConfig
from .device import DeviceProfile, profile
from .policy import Policy
from .probes import Probe, default_probes
from .reasons import Decision, NoBackendError, ProbeResult

#: Stages whose results are worth persisting (rule-only results are recomputed in microseconds).
STORED_STAGES = frozenset({"import", "graph_build", "compile", "run", "numerics", "measure"})


class ResultCache(Protocol):
    """The persistent tier (SQLite store, optionally a remote one behind it)."""

    def get(self, key: Any) -> ProbeResult | None: ...

    def put(self, key: Any, result: ProbeResult, **kw: Any) -> None: ...


class Selector:
    """Chooses a backend for a config on a device under a policy, and remembers the answer."""

    def __init__(self, probes: Iterable[Probe] | None = None, cache: ResultCache | None = None,
                 memo_size: int = 65536):  # fmt: skip
        self.probes: tuple[Probe, ...] = tuple(probes) if probes is not None else default_probes()
        self.cache = cache
        self._memo: dict[tuple, Decision] = {}
        self._results: dict[tuple, tuple[ProbeResult, ...]] = {}
        self._memo_size = memo_size
        self._lock = threading.Lock()
        self.stats = {"memo_hits": 0, "cache_hits": 0, "probes": 0}

    # ------------------------------------------------------------------ results
    def _cache_key(self, config: FusedAttnConfig, device: DeviceProfile, backend: str) -> Any:
        from .cache.keys import CacheKey, versions_key

        return CacheKey(config.key(), backend, device.fingerprint(), versions_key(device))

    def probe_all(self, config: FusedAttnConfig, device: DeviceProfile
                  ) -> tuple[tuple[ProbeResult, ...], str]:  # fmt: skip
        """Every candidate's raw result (before policy) and where they came from."""
        rkey = (config, device)
        hit = self._results.get(rkey)
        if hit is not None:
            return hit, "memo"
        results, source = [], "probe"
        for p in self.probes:
            result = None
            key = None
            if self.cache is not None:
                key = self._cache_key(config, device, p.name)
                result = self.cache.get(key)
                if result is not None:
                    self.stats["cache_hits"] += 1
                    source = "cache"
            if result is None:
                result = p.probe(config, device)
                self.stats["probes"] += 1
                if self.cache is not None and result.stage in STORED_STAGES:
                    self.cache.put(key, result, config=config.to_dict(), device=device.to_dict())
            results.append(result)
        out = tuple(results)
        with self._lock:
            if len(self._results) >= self._memo_size:
                self._results.clear()
            self._results[rkey] = out
        return out, source

    # ------------------------------------------------------------------ decisions
    def decide(self, config: FusedAttnConfig, device: DeviceProfile | str | None = None,
               policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
        """The full decision (never raises for "no backend": ``chosen`` is then ``None``)."""
        dev = profile(device)
        pol = policy if policy is not None else Policy.from_env()
        if force is not None:
            pol = pol.with_(force=force)
        mkey = (config, dev, pol)
        hit = self._memo.get(mkey)
        if hit is not None:
            self.stats["memo_hits"] += 1
            return hit
        raw, source = self.probe_all(config, dev)
        results = tuple(pol.filter(r) for r in raw)
        by_name = {r.backend: r for r in results}
        order = pol.order(dev.sm)
        chosen = next((b for b in order if by_name[b].supported), None)
        detail: dict[str, Any] = {}
        if chosen == "flash":
            detail["flash_variant"] = pol.flavour(by_name["flash"])
        if chosen == "fused":
            detail["fused_sub_backend"] = by_name["fused"].detail.get("sub_backend")
        decision = Decision(
            config=config,
            device=dev,
            chosen=chosen,
            results=results,
            policy=pol.to_dict(),
            source=source,
            order=order,
            detail=detail,
        )
        with self._lock:
            if len(self._memo) >= self._memo_size:
                self._memo.clear()
            self._memo[mkey] = decision
        return decision

    def select(self, config: FusedAttnConfig, device: DeviceProfile | str | None = None,
               policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
        """Like :meth:`decide`, but raises :class:`NoBackendError` when nothing is supported
        (also when a forced backend is unsupported: the error carries its reasons)."""
        decision = self.decide(config, device, policy, force)
        if decision.chosen is None:
            raise NoBackendError(decision)
        return decision

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._results.clear()


_DEFAULT: Selector | None = None


def default_selector() -> Selector:
    """The process-wide selector (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Selector()
    return _DEFAULT


def select(config: FusedAttnConfig, device: DeviceProfile | str | None = None,
           policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
    """Choose a backend; raises :class:`NoBackendError` listing every candidate's reasons."""
    return default_selector().select(config, device, policy, force)


def explain(config: FusedAttnConfig, device: DeviceProfile | str | None = None,
            policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
    """The full decision with every candidate's reasons, also when nothing is supported."""
    return default_selector().decide(config, device, policy, force)
