"""Mixed fleets: which backend each config runs on each device type, and agreement in a job.

* :func:`plan` answers "configs x device types" without those GPUs: a :class:`FleetPlan` whose
  cells are ``verified`` (the verdicts were produced on a real GPU of that type: the local GPU, or
  rows another machine left in the probe cache or its shared Redis tier) or ``predicted``
  (rules plus deviceless cuDNN graph builds).
* :func:`agree` runs inside a ``torch.distributed`` job: one rank per device type probes, every
  rank receives every type's results, and the ranks either each run their type's best
  (``local``) or all run the best backend supported everywhere (``uniform``). It always issues
  exactly two collectives, whatever the caches hold (see vLLM #57423).
* :func:`agree_from_env` reads ``TE_FL_ATTN_AGREE`` (``off`` | ``local`` | ``uniform``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import FusedAttnConfig
from .device import CATALOG, DeviceProfile, local, profile
from .policy import Policy
from .probes import Probe
from .reasons import (
    BACKENDS,
    DISPLAY_NAMES,
    FLASH_FLAVOURS,
    STAGES,
    Decision,
    NoBackendError,
    ProbeResult,
)
from .selector import Selector, narrow

log = logging.getLogger("te_fl_attention.fleet")

VERIFIED, PREDICTED = "verified", "predicted"
AGREE_ENV = "TE_FL_ATTN_AGREE"
AGREE_MODES = ("local", "uniform")
_OFF = ("", "off", "0", "none", "false", "no")
_RULE = STAGES.index("rule")
_REPORTED: set[str] = set()  # config keys whose divergence was logged by this process
_AGREED: dict[tuple[FusedAttnConfig, DeviceProfile], Decision] = {}  # see agreed()

Configs = Mapping[str, FusedAttnConfig] | Iterable[FusedAttnConfig | tuple[str, FusedAttnConfig]]


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


# ------------------------------------------------------------------------------------ helpers
def device_type(device: DeviceProfile) -> str:
    """The catalog name of a GPU's hardware (same sm and SM count, nearest memory size), else
    its own name: a real "NVIDIA H200" (139.8 GiB) is ``h200``, a catalog ``h100`` is ``h100``."""
    if device.source == "catalog" and device.name in CATALOG:
        return device.name
    same = [n for n, c in CATALOG.items()
            if device.sm is not None and (c.sm, c.sm_count) == (device.sm, device.sm_count)]
    if same and device.memory_gib is not None:
        same.sort(key=lambda n: abs((CATALOG[n].memory_gib or 0.0) - device.memory_gib))
    return same[0] if same else device.name


def describe(config: FusedAttnConfig) -> str:
    """A short label: ``32h/8kv d128 s8192 bf16 causal``."""
    c = config
    dims = f"d{c.head_dim_qk}" + (f"/{c.head_dim_v}" if c.head_dim_v != c.head_dim_qk else "")
    seq = f"s{c.max_seqlen_q}" + (f"/{c.max_seqlen_kv}" if c.max_seqlen_kv != c.max_seqlen_q
                                  else "")  # fmt: skip
    text = f"{c.num_heads}h/{c.num_gqa_groups}kv {dims} {seq} {c.dtype} {c.attn_mask_type}"
    if c.window_size not in ((-1, -1), (-1, 0)):
        text += f" w{c.window_size[0]}"
    return text + ("" if c.softmax_type == "vanilla" else f" {c.softmax_type}-softmax")


def choice_label(chosen: str | None, flavour: str | None = None) -> str:
    """``FlashAttention 2``, ``FusedAttention``... or ``no backend``."""
    if chosen is None:
        return "no backend"
    return DISPLAY_NAMES[flavour] if chosen == "flash" and flavour else DISPLAY_NAMES[chosen]


def _past_rule(results: Iterable[ProbeResult]) -> bool:
    return any(r.stage in STAGES and STAGES.index(r.stage) > _RULE for r in results)


def _named(configs: Configs) -> list[tuple[str, FusedAttnConfig]]:
    items = configs.items() if isinstance(configs, Mapping) else configs
    out: list[tuple[str, FusedAttnConfig]] = []
    seen: set[str] = set()
    for item in items:
        name, config = item if isinstance(item, tuple) else (describe(item), item)
        base, n = name, 1
        while name in seen:
            n += 1
            name = f"{base} #{n}"
        seen.add(name)
        out.append((name, config))
    return out


class _Recorded:
    """A probe stand-in that never probes: decisions are replayed from recorded results, held
    to this process's own rule stage (``probe``'s rules: a recorded result may only refuse
    more, see :func:`.selector.narrow`)."""

    def __init__(self, probe: Probe) -> None:
        self.name = probe.name
        self._probe = probe

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list:
        return self._probe.rules(config, device)

    def narrow(self, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
               ) -> ProbeResult | None:  # fmt: skip
        return narrow(self._probe, cached, config, device)

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        raise LookupError(f"no recorded {self.name} result for this config")


class _Replay:
    """Decisions from results probed elsewhere (another rank, another machine), through the
    selector's own policy code: a Selector whose only cache is the recorded results."""

    def __init__(self, probes: Sequence[Probe]) -> None:
        self._data: dict[tuple[str, str], ProbeResult] = {}
        self.selector = Selector([_Recorded(p) for p in probes], cache=self)

    def get_many(self, keys: list[Any]) -> dict[Any, ProbeResult]:
        return {k: self._data[k.config_key, k.backend] for k in keys
                if (k.config_key, k.backend) in self._data}  # fmt: skip

    def put_many(self, items: list[tuple]) -> int:
        return 0

    def __len__(self) -> int:
        return len(self._data)

    def decide(self, config: FusedAttnConfig, device: DeviceProfile,
               results: Iterable[ProbeResult], policy: Policy) -> Decision:  # fmt: skip
        ck = config.key()
        self._data.update(((ck, r.backend), r) for r in results)
        return self.selector.decide(config, device, policy)


# --------------------------------------------------------------------------- uniform choice
@dataclass(frozen=True)
class Uniform:
    """The best backend supported on every device type for one config, and why it won."""

    config: str
    chosen: str | None
    flash_variant: str | None
    why: tuple[str, ...]
    per_device: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return choice_label(self.chosen, self.flash_variant)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "chosen": self.chosen, "flash_variant": self.flash_variant,
                "label": self.label, "why": list(self.why), "per_device": dict(self.per_device)}


def _flavours(d: Decision) -> set[str]:
    return {v.backend for v in d.result("flash").variants if v.supported}


def clip(text: str, limit: int = 160) -> str:
    """The first line of ``text``, whitespace collapsed, at most ``limit`` characters."""
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def short_reason(r: ProbeResult) -> str:
    """One line on why a candidate is refused. For FlashAttention, the reason of the flavour
    closest to running (installed, fewest refusals) unless the policy disabled it outright."""
    reasons = r.reasons
    if r.variants and not (reasons and reasons[0].stage == "policy"):
        best = min(reversed(r.variants), key=lambda v: (
            any(x.code.endswith("not_installed") for x in v.reasons), len(v.reasons)))
        reasons = best.reasons or reasons
    return clip(reasons[0].message) if reasons else "refused"


def common_choice(decisions: Mapping[str, Decision]
                  ) -> tuple[str | None, str | None, tuple[str, ...]]:  # fmt: skip
    """``(chosen, flash flavour, why)``: the candidate supported on every device whose worst
    place in the devices' priority orders is best (then the sum of places, then display order).
    FlashAttention counts only with a flavour supported everywhere."""
    if not decisions:
        return None, None, ()
    pol = next(iter(decisions.values())).policy
    wanted = [pol["force"]] if pol.get("force") else list(pol.get("prefer") or ())
    scored, lost = [], {}
    for b in BACKENDS:
        if not all(b in d.order for d in decisions.values()):
            continue
        refused = {dev: d.result(b) for dev, d in decisions.items() if not d.result(b).supported}
        if refused:
            lost[b] = "refused on " + "; ".join(f"{dev} ({short_reason(r)})"
                                                for dev, r in refused.items())  # fmt: skip
            continue
        flavour = None
        if b == "flash" and any(d.result("flash").variants for d in decisions.values()):
            common = set.intersection(*(_flavours(d) for d in decisions.values()))
            flavour = next((f for f in (*wanted, "fa4", "fa3", "fa2")
                            if f in common and f in FLASH_FLAVOURS), None)  # fmt: skip
            if flavour is None:
                lost[b] = "no flash-attn flavour is supported on every device (" + "; ".join(
                    f"{dev}: {', '.join(sorted(_flavours(d))) or 'none'}"
                    for dev, d in decisions.items()) + ")"  # fmt: skip
                continue
        places = [d.order.index(b) + 1 for d in decisions.values()]
        scored.append(((max(places), sum(places), BACKENDS.index(b)), b, flavour))
    if not scored:
        return None, None, tuple(f"{DISPLAY_NAMES[b]}: {why}" for b, why in lost.items())
    scored.sort()
    (worst, total, _), chosen, flavour = scored[0]
    why = [f"{choice_label(chosen, flavour)}: supported on every device; worst place in the "
           f"devices' priority orders {worst}, sum of places {total}"]
    for (w, t, _), b, fl in scored[1:]:
        lost[b] = (f"supported on every device but ranked lower (worst place {w}, sum {t})"
                   + (f" as {DISPLAY_NAMES[fl]}" if fl else ""))  # fmt: skip
    why += [f"{DISPLAY_NAMES[b]}: {lost[b]}" for b in BACKENDS if b in lost]
    return chosen, flavour, tuple(why)


# ---------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Cell:
    """One (config, device) answer: the decision and whether it was verified or predicted."""

    config: str
    device: str
    decision: Decision
    status: str
    evidence: str

    @property
    def chosen(self) -> str | None:
        return self.decision.chosen

    @property
    def label(self) -> str:
        return choice_label(self.decision.chosen, self.decision.flash_variant)

    def refusals(self) -> list[tuple[str, str]]:
        """``(candidate, short reason)`` for every refused candidate."""
        return [(r.backend, short_reason(r)) for r in self.decision.results if not r.supported]

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "config": self.config, "device": self.device, "chosen": d.chosen,
            "flash_variant": d.flash_variant, "label": self.label, "status": self.status,
            "evidence": self.evidence, "probed_on": d.device.name,
            "refusals": [{"backend": b, "reason": why} for b, why in self.refusals()],
            "candidates": [
                {"backend": r.backend, "supported": r.supported, "stage": r.stage,
                 "evidence": r.evidence, "reasons": [x.to_dict() for x in r.reasons],
                 "variants": [{"backend": v.backend, "supported": v.supported,
                               "reasons": [x.message for x in v.reasons]} for v in r.variants]}
                for r in d.results
            ],
        }  # fmt: skip


@dataclass
class FleetPlan:
    """Configs x device types. ``cells[(config name, device label)]``."""

    configs: list[tuple[str, FusedAttnConfig]]
    devices: list[tuple[str, DeviceProfile]]
    cells: dict[tuple[str, str], Cell]
    policy: Policy

    def cell(self, config: str, device: str) -> Cell:
        return self.cells[config, device]

    def table(self) -> list[list[str]]:
        """Header row then one row per config: ``FusedAttention (verified)``... per device."""
        rows = [["config", *(label for label, _ in self.devices)]]
        for name, _ in self.configs:
            rows.append([name, *(f"{c.label} ({c.status})" for c in
                                 (self.cells[name, label] for label, _ in self.devices))])
        return rows  # fmt: skip

    def uniform(self) -> dict[str, Uniform]:
        """Per config: the best backend supported on every listed device, with the reasons."""
        out = {}
        for name, _ in self.configs:
            per = {label: self.cells[name, label].decision for label, _ in self.devices}
            chosen, flavour, why = common_choice(per)
            out[name] = Uniform(name, chosen, flavour, why,
                                {k: choice_label(d.chosen, d.flash_variant) for k, d in
                                 per.items()})  # fmt: skip
        return out

    def summary(self) -> list[str]:
        """Plain-language findings: fallbacks per device (devices with the same list share a
        line), configs whose backend differs across devices, the verified share."""
        lines = []
        for chosen, verb in ((None, ("has no backend", "have no backend")),
                             ("unfused", ("falls back to unfused", "fall back to unfused")),
                             ("triton", ("runs our Triton kernel", "run our Triton kernel"))):
            groups: dict[tuple[str, ...], list[str]] = {}
            for label, _ in self.devices:
                names = tuple(n for n, _ in self.configs if self.cells[n, label].chosen == chosen)
                if names:
                    groups.setdefault(names, []).append(label)
            for names, labels in groups.items():
                lines.append(f"on {', '.join(labels)} {len(names)} config"
                             f"{'s' * (len(names) != 1)} {verb[len(names) != 1]}: "
                             f"{', '.join(names)}")
        split = [name for name, _ in self.configs
                 if len({self.cells[name, lab].label for lab, _ in self.devices}) > 1]
        if split:
            lines.append(f"{len(split)} config{'s' * (len(split) != 1)} choose"
                         f"{'s' * (len(split) == 1)} different backends across devices: "
                         f"{', '.join(split)}")
        n = sum(c.status == VERIFIED for c in self.cells.values())
        lines.append(f"{n} of {len(self.cells)} answers verified on a real GPU; the rest predicted "
                     "(rules + deviceless cuDNN)")
        return lines  # fmt: skip

    def to_dict(self, uniform: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy.to_dict(),
            "devices": [{"label": lab, "type": device_type(d), "device": d.to_dict()}
                        for lab, d in self.devices],
            "configs": [{"name": n, "key": c.key(), "config": c.to_dict()}
                        for n, c in self.configs],
            "cells": [self.cells[n, lab].to_dict() for n, _ in self.configs
                      for lab, _ in self.devices],
            "summary": self.summary(),
        }  # fmt: skip
        if uniform:
            out["uniform"] = [u.to_dict() for u in self.uniform().values()]
        return out


def _device_label(spec: str | DeviceProfile) -> tuple[str, DeviceProfile]:
    return (spec.name, spec) if isinstance(spec, DeviceProfile) else (spec, profile(spec))


def _changed_fields(dev: DeviceProfile) -> dict[str, Any]:
    """The fields a what-if spec (``h100:cudnn=9.10.2``) changed from its catalog entry."""
    base = CATALOG.get(dev.name)
    if base is None or dev.source != "catalog":
        return {}
    return {f: getattr(dev, f) for f in dev.to_dict() if getattr(dev, f) != getattr(base, f)}


def _matches(real: DeviceProfile, wanted: DeviceProfile) -> bool:
    """A real GPU answers for ``wanted``: same device type, and every field the spec changed
    (``cudnn=9.10.2``) equal on it."""
    if real.source != "local" or not real.has_gpu or device_type(real) != device_type(wanted):
        return False
    return all(getattr(real, f) == v for f, v in _changed_fields(wanted).items())


def _real_contexts(cache: Any, config: FusedAttnConfig, names: Sequence[str]
                   ) -> list[tuple[float, DeviceProfile, dict[str, ProbeResult]]]:  # fmt: skip
    """Complete result sets for ``config`` probed on real GPUs (local store, Redis tier),
    newest first."""
    from .cache.keys import package_version

    rows = getattr(cache, "iter_rows", None)
    if rows is None:
        return []
    groups: dict[tuple[str, str], list[Any]] = {}
    for row in rows(config_prefix=config.key()):
        if (row.key.config_key == config.key() and row.device
                and row.device.get("source") == "local" and row.device.get("sm") is not None
                and row.package_version == package_version()):  # fmt: skip
            groups.setdefault((row.key.device_fp, row.key.versions_key), []).append(row)
    out = []
    for group in groups.values():
        results = {r.key.backend: r.probe_result for r in group}
        if all(n in results for n in names) and _past_rule(results[n] for n in names):
            try:
                dev = DeviceProfile.from_dict(group[0].device)
            except (TypeError, ValueError):
                continue
            out.append((max(r.created_at for r in group), dev, {n: results[n] for n in names}))
    out.sort(key=lambda t: -t[0])
    return out


def plan(configs: Configs, devices: Sequence[str | DeviceProfile], policy: Policy | None = None,
         selector: Selector | None = None, progress: Callable[[], None] | None = None
         ) -> FleetPlan:  # fmt: skip
    """Every config on every device type.

    A cell is ``verified`` when its verdicts were produced on a real GPU of that type (same
    catalog type, and equal on every field the spec overrides) that reached a stage past
    ``rule``: the local GPU (probed now), or result rows a real GPU left in the cache. Anything
    else is ``predicted``: rules plus deviceless cuDNN graph builds. ``progress`` is called
    after each cell."""
    from .selector import default_selector

    sel = selector if selector is not None else default_selector()
    pol = policy if policy is not None else Policy.from_env()
    named = _named(configs)
    devs = [_device_label(d) for d in devices]
    if not named or not devs:
        raise ValueError("a fleet plan needs at least one config and one device")
    here = local()
    names = [p.name for p in sel.probes]
    replays: dict[DeviceProfile, _Replay] = {}
    cells: dict[tuple[str, str], Cell] = {}
    for cname, config in named:
        real = _real_contexts(sel.cache, config, names) if sel.cache is not None else []
        for label, dev in devs:
            found = next(((d, res) for _, d, res in real if _matches(d, dev)), None)
            if found is not None:
                rdev, results = found
                replay = replays.setdefault(rdev, _Replay(sel.probes))
                decision = replay.decide(config, rdev, results.values(), pol)
                cell = Cell(cname, label, decision, VERIFIED, f"probed on {rdev.name} "
                            f"(cuDNN {rdev.cudnn or 'unknown'}), from the cache")  # fmt: skip
            else:
                target = here if (dev.source == "catalog" and _matches(here, dev)) else dev
                decision = sel.decide(config, target, pol)
                real_gpu = target.source == "local" and target.has_gpu
                if real_gpu and _past_rule(decision.results):
                    cell = Cell(cname, label, decision, VERIFIED, f"probed on {target.name}")
                else:
                    fused = next((r for r in decision.results if r.backend == "fused"), None)
                    how = fused.evidence if fused is not None and fused.evidence != "rules" \
                        else "rules"  # fmt: skip
                    cell = Cell(cname, label, decision, PREDICTED,
                                "rules" + (f" + {how}" if how != "rules" else ""))
            cells[cname, label] = cell
            if progress is not None:
                progress()
    return FleetPlan(named, devs, cells, pol)


# --------------------------------------------------------------------------------- agreement
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
                    f"supported, ranked after {DISPLAY_NAMES.get(d.chosen or '', 'nothing')} " \
                    f"({' > '.join(d.order)})"  # fmt: skip
                lines.append(f"on {lab}, {DISPLAY_NAMES[other]}: {why}")
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
    from .cache.keys import versions_key
    from .selector import default_selector

    sel = selector if selector is not None else default_selector()
    pol = policy if policy is not None else Policy.from_env()
    dev = profile(device)
    configs = list(configs)
    own = {c.key(): c for c in configs}
    names = [p.name for p in sel.probes]
    vk = versions_key(dev, probe_env=sel.probe_env())
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

    replays = {key: _Replay(sel.probes) for key in types}

    def decide(tkey: str, ck: str, policy: Policy | None = None) -> Decision:
        t = types[tkey]
        return replays[tkey].decide(every[ck], t.device, results[tkey][ck], policy or t.policy)

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
            d = replays[mine.key].decide(config, dev, results[mine.key][config.key()], pol)
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
        d = replays[mine.key].decide(config, dev, results[mine.key][ck], pref)
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
    from .cache.keys import CacheKey

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
