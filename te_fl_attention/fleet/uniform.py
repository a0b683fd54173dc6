"""The uniform choice: the best backend supported on every device type, for one config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import backends
from ..reasons import Decision
from .labels import choice_label, short_reason


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


def _flavours(d: Decision, name: str) -> set[str]:
    return {v.backend for v in d.result(name).variants if v.supported}


def common_choice(decisions: Mapping[str, Decision]
                  ) -> tuple[str | None, str | None, tuple[str, ...]]:  # fmt: skip
    """``(chosen, flash flavour, why)``: the candidate supported on every device whose worst
    place in the devices' priority orders is best (then the sum of places, then display order).
    FlashAttention counts only with a flavour supported everywhere."""
    if not decisions:
        return None, None, ()
    candidates, display = backends.names(), backends.display_names()
    pol = next(iter(decisions.values())).policy
    wanted = [pol["force"]] if pol.get("force") else list(pol.get("prefer") or ())
    scored, lost = [], {}
    for b in candidates:
        if not all(b in d.order for d in decisions.values()):
            continue
        refused = {dev: d.result(b) for dev, d in decisions.items() if not d.result(b).supported}
        if refused:
            lost[b] = "refused on " + "; ".join(f"{dev} ({short_reason(r)})"
                                                for dev, r in refused.items())  # fmt: skip
            continue
        flavour = None
        if any(d.result(b).variants for d in decisions.values()):
            common = set.intersection(*(_flavours(d, b) for d in decisions.values()))
            order = backends.precedence(b)
            flavour = next((f for f in (*wanted, *order) if f in common and f in order), None)
            if flavour is None:
                lost[b] = f"no {display[b]} flavour is supported on every device (" + "; ".join(
                    f"{dev}: {', '.join(sorted(_flavours(d, b))) or 'none'}"
                    for dev, d in decisions.items()) + ")"  # fmt: skip
                continue
        places = [d.order.index(b) + 1 for d in decisions.values()]
        scored.append(((max(places), sum(places), candidates.index(b)), b, flavour))
    if not scored:
        return None, None, tuple(f"{display[b]}: {why}" for b, why in lost.items())
    scored.sort()
    (worst, total, _), chosen, flavour = scored[0]
    why = [f"{choice_label(chosen, flavour)}: supported on every device; worst place in the "
           f"devices' priority orders {worst}, sum of places {total}"]
    for (w, t, _), b, fl in scored[1:]:
        lost[b] = (f"supported on every device but ranked lower (worst place {w}, sum {t})"
                   + (f" as {display[fl]}" if fl else ""))  # fmt: skip
    why += [f"{display[b]}: {lost[b]}" for b in candidates if b in lost]
    return chosen, flavour, tuple(why)
