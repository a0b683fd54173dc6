"""`Selector`: memo -> probe cache -> probes -> policy -> `Decision`.

The hot path is a dict lookup keyed on the frozen (config, device, policy) triple: no I/O, no
hashing beyond the dataclasses' own ``__hash__``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any, Protocol

from .config import FusedAttnConfig
from .device import DeviceProfile, profile
from .policy import Policy
from .probes import Probe, default_probes
from .reasons import Decision, NoBackendError, ProbeResult


class ResultCache(Protocol):
    """The persistent tier (SQLite store, optionally a remote one behind it)."""

    def get_many(self, keys: list[Any]) -> dict[Any, ProbeResult]: ...

    def put_many(self, items: list[tuple]) -> int: ...


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
        self._probe_env: dict[str, Any] | None = None
        self._vkeys: dict[DeviceProfile, str] = {}

    # ------------------------------------------------------------------ results
    def probe_env(self) -> dict[str, Any]:
        """What this process's probes can run, folded into every cache key: a digest of the
        probe and rule sources, the installed cuDNN / cudnn-frontend, whether graphs are built.
        A change in any of them is a miss, never a stale hit."""
        if self._probe_env is None:
            from .device import installed_versions

            digest = hashlib.sha256()
            for p in self.probes:
                mod = sys.modules.get(type(p).__module__)
                path = getattr(mod, "__file__", None)
                if path and os.path.exists(path):
                    with open(path, "rb") as fh:
                        digest.update(fh.read())
                digest.update(repr(sorted(vars(p).items())).encode())
            for helper in ("base", "common"):
                with open(os.path.join(os.path.dirname(__file__), "probes", f"{helper}.py"),
                          "rb") as fh:  # fmt: skip
                    digest.update(fh.read())
            inst = installed_versions()
            self._probe_env = {"rules": digest.hexdigest()[:32], "cudnn": inst["cudnn"],
                               "cudnn_frontend": inst["cudnn_frontend"]}  # fmt: skip
        return self._probe_env

    def prepare(self, device: DeviceProfile | str | None = None) -> None:
        """Start-up work, done once so the first selection is a lookup: resolve the device,
        digest the probes, compute the device's cache-key parts and open the store."""
        dev = profile(device)
        self._cache_keys(FusedAttnConfig(), dev)
        if self.cache is not None:
            len(self.cache)

    def _cache_keys(self, config: FusedAttnConfig, device: DeviceProfile) -> dict[str, Any]:
        from .cache.keys import CacheKey, versions_key

        vk = self._vkeys.get(device)
        if vk is None:
            vk = self._vkeys[device] = versions_key(device, probe_env=self.probe_env())
        ck, fp = config.key(), device.fingerprint()
        return {p.name: CacheKey(ck, p.name, fp, vk) for p in self.probes}

    def probe_all(self, config: FusedAttnConfig, device: DeviceProfile
                  ) -> tuple[tuple[ProbeResult, ...], str]:  # fmt: skip
        """Every candidate's raw result (before policy) and where they came from: the memo,
        the persistent cache (one query for all candidates), or the probes (then written back
        in one transaction)."""
        rkey = (config, device)
        hit = self._results.get(rkey)
        if hit is not None:
            return hit, "memo"
        keys = self._cache_keys(config, device) if self.cache is not None else {}
        found = self.cache.get_many(list(keys.values())) if keys else {}
        results, fresh = [], []
        for p in self.probes:
            result = found.get(keys[p.name]) if keys else None
            if result is None:
                result = p.probe(config, device)
                self.stats["probes"] += 1
                fresh.append((keys.get(p.name), result))
            else:
                self.stats["cache_hits"] += 1
            results.append(result)
        if self.cache is not None and fresh:
            self.cache.put_many(
                [(k, r, config.to_dict(), device.to_dict()) for k, r in fresh]
            )
        out = tuple(results)
        with self._lock:
            if len(self._results) >= self._memo_size:
                self._results.clear()
            self._results[rkey] = out
        return out, ("probe" if fresh else "cache")

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
        drift = {r.backend: r.detail["rule_drift"] for r in raw if r.detail.get("rule_drift")}
        if drift:
            detail["rule_drift"] = drift
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
    """The process-wide selector (created on first use). ``TE_FL_ATTN_CUDNN_PROBE=0`` keeps
    FusedAttention at its rule stage (no cuDNN graph builds)."""
    global _DEFAULT
    if _DEFAULT is None:
        from .cache.store import default_cache

        graph = os.environ.get("TE_FL_ATTN_CUDNN_PROBE", "1") != "0"
        _DEFAULT = Selector(default_probes(graph=graph), cache=default_cache())
    return _DEFAULT


def select(config: FusedAttnConfig, device: DeviceProfile | str | None = None,
           policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
    """Choose a backend; raises :class:`NoBackendError` listing every candidate's reasons."""
    return default_selector().select(config, device, policy, force)


def explain(config: FusedAttnConfig, device: DeviceProfile | str | None = None,
            policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
    """The full decision with every candidate's reasons, also when nothing is supported."""
    return default_selector().decide(config, device, policy, force)
