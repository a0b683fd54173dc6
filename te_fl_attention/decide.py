"""The decision, as a pure function: ``decide(config, device, results, policy) -> Decision``.

``results`` are every candidate's evidence (the probes' results, with the verify and measure
stages' findings merged in where they ran); the policy filters them (switches, force), orders the
survivors (TE's priority from the registry, preferences first, timed candidates fastest first in
measured mode) and picks the first supported one. No I/O, no cache, no probing: the selector and
fleet planning call this same function with their own results.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import backends
from .config import FusedAttnConfig
from .device import DeviceProfile
from .policy import Policy
from .reasons import Decision, ProbeResult


def metric(config: FusedAttnConfig) -> str:
    """What measured mode compares: ``fwd_bwd`` for training configs, ``fwd`` for inference."""
    return "fwd_bwd" if config.is_training else "fwd"


def decide(config: FusedAttnConfig, device: DeviceProfile, results: Iterable[ProbeResult],
           policy: Policy, *, source: str = "probe",
           measured: Mapping[str, Any] | None = None) -> Decision:  # fmt: skip
    """The decision for ``config`` on ``device`` from every candidate's ``results`` under
    ``policy``. ``source`` says where the results came from (``probe``, ``cache``, ``memo``,
    ``recorded``...); ``measured`` is what the Decision says about measured mode (metric, the
    timed shape; :func:`te_fl_attention.measure.describe`), used when ``policy.measure``."""
    raw = tuple(results)
    detail: dict[str, Any] = {}
    if policy.verify and device.source != "local":
        detail["numerics_note"] = (f"{device.name} is a what-if profile: nothing is verified "
                                   "from this machine")  # fmt: skip
    seen = tuple([policy.filter(r) for r in raw])
    by_name = {r.backend: r for r in seen}
    times = timings(seen, config) if policy.measure else {}
    timed = candidate_times(by_name, times, policy) if policy.measure else {}
    order = policy.order(device.sm, timed) if timed else _order(policy, device.sm)
    chosen = next((b for b in order if b in by_name and by_name[b].supported), None)
    if policy.measure:
        detail["timings_ms"] = timings(seen, config, all_=True)
        detail["measured"] = {
            **(measured or {"metric": metric(config)}),
            "priority_choice": next((b for b in policy.order(device.sm)
                                     if b in by_name and by_name[b].supported), None),
            "untimed": [b for b in order if b in by_name and by_name[b].supported
                        and b not in timed],
        }  # fmt: skip
    if chosen is not None:
        won = by_name[chosen]
        if won.variants:
            detail[f"{chosen}_variant"] = policy.flavour(won, times or None)
        if "sub_backend" in won.detail:  # which engine of the candidate runs (cuDNN's)
            detail[f"{chosen}_sub_backend"] = won.detail["sub_backend"]
    drift = {r.backend: r.detail["rule_drift"] for r in raw if r.detail.get("rule_drift")}
    if drift:
        detail["rule_drift"] = drift
    out = _new(Decision)  # the frozen dataclass's __init__ is 8 setattr calls: set them at once
    out.__dict__.update(config=config, device=device, chosen=chosen, results=seen,
                        policy=policy.to_dict(), source=source, order=order, detail=detail)
    return out


_new = object.__new__
_ORDERS: dict[tuple[Policy, int | None, int], tuple[str, ...]] = {}


def _order(policy: Policy, sm: int | None) -> tuple[str, ...]:
    """``policy.order(sm)`` (no timings), remembered per (policy, sm, registry version)."""
    key = (policy, sm, backends.version())
    hit = _ORDERS.get(key)
    if hit is None:
        if len(_ORDERS) >= 1024:
            _ORDERS.clear()
        hit = _ORDERS[key] = policy.order(sm)
    return hit


def units(result: ProbeResult) -> tuple[ProbeResult, ...]:
    """What runs of a candidate: its flavours when it has them, else itself."""
    return result.variants if result.variants else (result,)


def timings(results: Iterable[ProbeResult], config: FusedAttnConfig, all_: bool = False
            ) -> dict[str, Any]:  # fmt: skip
    """Unit -> the measured metric in ms (``all_``: unit -> every timing) of supported units."""
    m, out = metric(config), {}
    for r in results:
        for u in units(r):
            t = u.detail.get("timings_ms")
            if u.supported and t and m in t:  # untimed units keep their rule-priority slot
                out[u.backend] = t if all_ else t[m]
    return out


def candidate_times(by_name: Mapping[str, ProbeResult], times: Mapping[str, float],
                    policy: Policy) -> dict[str, float]:  # fmt: skip
    """Candidate -> ms; a multi-flavour candidate counts with the flavour the policy runs."""
    out = {b: t for b, t in times.items() if b in by_name}
    for name, r in by_name.items():
        if r.variants and r.supported:
            flavour = policy.flavour(r, times or None)
            if flavour in times:
                out[name] = times[flavour]
    return out


__all__ = ["decide", "metric", "timings", "candidate_times", "units"]
