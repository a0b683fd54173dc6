"""Agreement inside a ``torch.distributed`` job: the decision every rank runs.

:func:`agree`: one rank per device type probes, every rank receives every type's results, and the
ranks either each run their type's best (``local``) or all run the best backend supported
everywhere (``uniform``). It always issues exactly two collectives, whatever the caches hold (see
vLLM #57423). :func:`agreed` is the lookup a plugin consults; :func:`agree_from_env` reads
``TE_FL_ATTN_AGREE`` (``off`` | ``local`` | ``uniform``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import backends
from ..config import FusedAttnConfig
from ..device import DeviceProfile, profile
from ..policy import Policy
from ..reasons import Decision, NoBackendError, ProbeResult
from ..selector import Selector
from .labels import choice_label, describe, short_reason
from .replay import replay
from .uniform import common_choice

log = logging.getLogger("te_fl_attention.fleet")

AGREE_ENV = "TE_FL_ATTN_AGREE"
AGREE_MODES = ("local", "uniform")
_OFF = ("", "off", "0", "none", "false", "no")
_REPORTED: set[str] = set()  # config keys whose divergence was logged by this process
_AGREED: dict[tuple[FusedAttnConfig, DeviceProfile], Decision] = {}  # see agreed()


def agree_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``TE_FL_ATTN_AGREE``: ``local`` or ``uniform``; ``None`` for ``off`` (the default).

    Read with ``os.environ.get`` (torch.compile guards it). Anything else raises ValueError."""
    raw = (os.environ.get(AGREE_ENV) if environ is None else environ.get(AGREE_ENV)) or "off"
    mode = raw.strip().lower()
    if mode in _OFF:
        return None
    if mode not in AGREE_MODES:
        raise ValueError(f"{AGREE_ENV}={raw!r} is not valid; allowed: off, local, uniform")
    return mode


def agreed(config: FusedAttnConfig, device: str | DeviceProfile | None = None
           ) -> Decision | None:  # fmt: skip
    """The decision an earlier :func:`agree` in this process returned for ``config`` on
    ``device`` (default: the local GPU), or ``None``. A lookup, never a collective: what a
    plugin consults on its hot path."""
    return _AGREED.get((config, profile(device)))


@dataclass(frozen=True)
class _Type:
    """One device type in a job: hardware fingerprint + versions key, and its prober rank."""

    key: str
    label: str
    device: DeviceProfile
    versions_key: str
    prober: int
    ranks: tuple[int, ...]
    policy: Policy


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def dist_ready() -> bool:
    """True when torch.distributed is importable and a default process group is up."""
    return _dist() is not None


def _gather(dist: Any, obj: Any, group: Any) -> list[Any]:
    """One collective: every rank's ``obj`` (all_gather_object, any backend)."""
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _probe_payload(sel: Selector, configs: Mapping[str, FusedAttnConfig], dev: DeviceProfile
                   ) -> dict[str, Any]:  # fmt: skip
    """The prober's results per config key (cache hits included), or the error it met."""
    try:
        results, probed = {}, 0
        for key, config in configs.items():
            raw, source = sel.probe_all(config, dev)
            probed += source == "probe"
            results[key] = [r.to_dict() for r in raw]
        return {"results": results, "probed": probed}
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it after the collective
        return {"error": f"{type(exc).__name__}: {exc}"}


def _types(infos: list[dict[str, Any]]) -> dict[str, _Type]:
    by_key: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        by_key.setdefault(info["type"], []).append(rank)
    names: dict[str, int] = {}
    for ranks in by_key.values():
        name = infos[ranks[0]]["device"]["name"]
        names[name] = names.get(name, 0) + 1
    out = {}
    for key, ranks in by_key.items():
        info = infos[ranks[0]]
        dev = DeviceProfile.from_dict(info["device"])
        label = dev.name if names[dev.name] == 1 else f"{dev.name}#{info['versions_key'][:6]}"
        out[key] = _Type(key, label, dev, info["versions_key"], ranks[0], tuple(ranks),
                         Policy(**info["policy"]))  # fmt: skip
    return out


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def _divergence(configs: Mapping[str, FusedAttnConfig], types: dict[str, _Type],
                decide: Callable[[str, str], Decision],
                results: dict[str, dict[str, Any]]) -> list[str]:  # fmt: skip
    """Configs whose device types choose differently, with the reasons; configs that diverge
    for the same reasons share one paragraph."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for ck, config in configs.items():
        have = [k for k in types if ck in results[k]]
        if len(have) < 2 or ck in _REPORTED:
            continue
        ds = {types[k].label: decide(k, ck) for k in have}
        labels = {lab: choice_label(d.chosen, d.flash_variant) for lab, d in ds.items()}
        if len(set(labels.values())) < 2:
            continue
        _REPORTED.add(ck)
        lines = ["; ".join(f"{lab} -> {c}" for lab, c in labels.items())]
        for lab, d in ds.items():
            for other in sorted({o.chosen for o in ds.values()} - {d.chosen, None}):
                r = d.result(other)
                why = short_reason(r) if not r.supported else \
                    f"supported, ranked after {backends.display(d.chosen or '', 'nothing')} " \
                    f"({' > '.join(d.order)})"  # fmt: skip
                lines.append(f"on {lab}, {backends.display_names()[other]}: {why}")
        groups.setdefault(tuple(lines), []).append(describe(config))
    out = []
    for (head, *why), names in groups.items():
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        out.append(f"  {len(names)} config{'s' * (len(names) != 1)} ({shown}): {head}")
        out += [f"    {w}" for w in why]
    return out


def _no_common(config: FusedAttnConfig, types: dict[str, _Type], ds: dict[str, Decision],
               why: Sequence[str]) -> str:  # fmt: skip
    lines = [f"no attention backend is supported on every device type in this job "
             f"({AGREE_ENV}=uniform) for {describe(config)}:"]  # fmt: skip
    for key, t in types.items():
        d = ds[key]
        lines.append(f"  {t.label} ({_ranks_text(t.ranks)}): would choose "
                     f"{choice_label(d.chosen, d.flash_variant)}")  # fmt: skip
        for r in d.results:
            verdict = "; ".join(f"[{x.stage}] {x.message}" for x in r.reasons) or "supported"
            lines.append(f"    {r.display_name}: {verdict}")
    lines += [f"  {w}" for w in why]
    return "\n".join(lines)


def _wanted(infos: list[dict[str, Any]], types: dict[str, _Type], mode: str,
            own: Mapping[str, FusedAttnConfig]) -> tuple[dict[str, FusedAttnConfig],
                                                         dict[str, list[str]]]:  # fmt: skip
    """Every config of the job (first seen first) and, per device type, the config keys its
    prober answers: the configs of its own ranks (``local``) or of every rank (``uniform``)."""
    every: dict[str, FusedAttnConfig] = {}
    for info in infos:
        for ck, d in info["configs"].items():
            if ck not in every:
                every[ck] = own.get(ck) or FusedAttnConfig.from_dict(d)
    wanted = {}
    for key, t in types.items():
        ranks = range(len(infos)) if mode == "uniform" else t.ranks
        need = {ck for r in ranks for ck in infos[r]["configs"]}
        wanted[key] = [ck for ck in every if ck in need]
    return every, wanted


def agree(configs: Iterable[FusedAttnConfig], group: Any = None, mode: str = "local",
          device: str | DeviceProfile | None = None, selector: Selector | None = None,
          policy: Policy | None = None) -> list[Decision]:  # fmt: skip
    """Decisions for ``configs`` agreed across the ranks of ``group``. Every rank must call it
    the same number of times (it is a collective); the configs may differ between ranks.

    Ranks of one device type (fingerprint + versions key) let their lowest rank probe; the
    results are exchanged and written to each rank's cache. ``mode="local"``: each rank gets its
    own type's best (a divergence between types is logged once, with the reasons, by rank 0).
    ``mode="uniform"``: every rank gets, per config, the best backend supported on every type,
    or every rank raises :class:`NoBackendError` listing each type's reasons. Exactly two
    ``all_gather_object`` calls per call, whatever the caches hold; none when torch.distributed
    is not initialized."""
    if mode not in AGREE_MODES:
        raise ValueError(f"mode={mode!r} is not valid; allowed: {', '.join(AGREE_MODES)}")
    from ..selector import default_selector

    sel = selector if selector is not None else default_selector()
    pol = policy if policy is not None else Policy.from_env()
    dev = profile(device)
    configs = list(configs)
    own = {c.key(): c for c in configs}
    names = [p.name for p in sel.probes]
    vk = sel.keys.versions(dev)
    dist = _dist()
    rank = dist.get_rank(group) if dist is not None else 0
    me = {"type": f"{dev.fingerprint()}:{vk}", "device": dev.to_dict(), "versions_key": vk,
          "policy": pol.to_dict(), "probes": names,
          "configs": {ck: c.to_dict() for ck, c in own.items()}}  # fmt: skip
    infos = _gather(dist, me, group)  # collective 1 of 2
    types = _types(infos)
    mine = types[me["type"]]
    every, wanted = _wanted(infos, types, mode, own)
    payload = None
    if mine.prober == rank:
        payload = _probe_payload(sel, {ck: every[ck] for ck in wanted[mine.key]}, dev)
    payloads = _gather(dist, payload, group)  # collective 2 of 2 (always, hit or miss)

    # Everything below is computed from the same gathered data on every rank: any error is
    # raised by every rank alike, after the collectives.
    if any(i["probes"] != names for i in infos):
        raise ValueError("agree: ranks use different candidate probes")
    results: dict[str, dict[str, tuple[ProbeResult, ...]]] = {}
    for key, t in types.items():
        p = payloads[t.prober]
        if p is None or "error" in p:
            raise RuntimeError(f"agree: probing on rank {t.prober} ({t.label}) failed: "
                               f"{(p or {}).get('error', 'no results')}")  # fmt: skip
        results[key] = {ck: tuple(ProbeResult.from_dict(r) for r in rs)
                        for ck, rs in p["results"].items()}  # fmt: skip
    _remember(sel, every, types, results, skip=mine.key if mine.prober == rank else None)


    def decide(tkey: str, ck: str, policy: Policy | None = None) -> Decision:
        t = types[tkey]
        return replay(every[ck], t.device, results[tkey][ck], sel.probes, policy or t.policy)

    source = "probe" if payloads[mine.prober]["probed"] else "cache"
    agreement = {"mode": mode, "device_type": mine.label, "prober_rank": mine.prober,
                 "types": {t.label: list(t.ranks) for t in types.values()}}  # fmt: skip
    out = []
    if mode == "local":
        lines = _divergence(every, types, decide, results) if rank == 0 else []
        if lines:
            log.warning("attention backends differ across the device types of this job (%s="
                        "local: each type runs its own best):\n%s", AGREE_ENV, "\n".join(lines))
        for config in configs:
            d = replay(config, dev, results[mine.key][config.key()], sel.probes, pol)
            out.append(dataclasses.replace(d, source=source,
                                           detail={**d.detail, "agreement": agreement}))
        return _record(out)
    for config in configs:
        ck = config.key()
        ds = {k: decide(k, ck) for k in types}
        chosen, flavour, why = common_choice({types[k].label: d for k, d in ds.items()})
        if chosen is None:
            raise NoBackendError(ds[mine.key], _no_common(config, types, ds, why))
        pref = mine.policy.with_(prefer=(flavour or chosen, *mine.policy.prefer))
        d = replay(config, dev, results[mine.key][ck], sel.probes, pref)
        detail = {**d.detail, "agreement": {**agreement, "why": list(why), "per_type": {
            types[k].label: choice_label(x.chosen, x.flash_variant) for k, x in ds.items()}}}
        out.append(dataclasses.replace(d, source=source, detail=detail))
    return _record(out)


def _record(decisions: list[Decision]) -> list[Decision]:
    if len(_AGREED) > 65536:
        _AGREED.clear()
    _AGREED.update(((d.config, d.device), d) for d in decisions)
    return decisions


def _remember(sel: Selector, every: Mapping[str, FusedAttnConfig], types: dict[str, _Type],
              results: dict[str, dict[str, tuple[ProbeResult, ...]]], skip: str | None) -> None:
    """Write every type's results to this rank's cache (the prober's own are already there)."""
    from ..cache.keys import CacheKey

    cache = sel.cache
    if cache is None:
        return
    items = []
    for key, t in types.items():
        if key == skip:
            continue
        fp, dd = t.device.fingerprint(), t.device.to_dict()
        for ck, rs in results[key].items():
            cd = every[ck].to_dict()
            items += [(CacheKey(ck, r.backend, fp, t.versions_key), r, cd, dd) for r in rs]
    if items:
        try:
            cache.put_many(items, on_conflict="ignore")  # type: ignore[call-arg]
        except TypeError:  # a cache without on_conflict
            cache.put_many(items)
