"""Fleet planning: which backend each config runs on each device type, without those GPUs.

:func:`plan` returns a :class:`FleetPlan` whose cells are ``verified`` (the verdicts were produced
on a real GPU of that type: the local GPU, or rows another machine left in the probe cache or its
shared Redis tier) or ``predicted`` (rules plus deviceless cuDNN graph builds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import FusedAttnConfig
from ..device import CATALOG, DeviceProfile, local, profile
from ..policy import Policy
from ..reasons import STAGES, Decision, ProbeResult
from ..selector import Selector
from .labels import choice_label, describe, device_type, short_reason
from .replay import replay
from .uniform import Uniform, common_choice

VERIFIED, PREDICTED = "verified", "predicted"
_RULE = STAGES.index("rule")

Configs = Mapping[str, FusedAttnConfig] | Iterable[FusedAttnConfig | tuple[str, FusedAttnConfig]]


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
    from ..cache.keys import package_version

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
    from ..selector import default_selector

    sel = selector if selector is not None else default_selector()
    pol = policy if policy is not None else Policy.from_env()
    named = _named(configs)
    devs = [_device_label(d) for d in devices]
    if not named or not devs:
        raise ValueError("a fleet plan needs at least one config and one device")
    here = local()
    names = [p.name for p in sel.probes]
    cells: dict[tuple[str, str], Cell] = {}
    for cname, config in named:
        real = _real_contexts(sel.cache, config, names) if sel.cache is not None else []
        for label, dev in devs:
            found = next(((d, res) for _, d, res in real if _matches(d, dev)), None)
            if found is not None:
                rdev, results = found
                decision = replay(config, rdev, results.values(), sel.probes, pol)
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
