"""Short labels of the fleet's answers: device types, config descriptions, choices, reasons."""

from __future__ import annotations

from .. import backends
from ..config import FusedAttnConfig
from ..device import CATALOG, DeviceProfile
from ..reasons import ProbeResult


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
    names = backends.display_names()
    return names[flavour] if flavour and backends.parent().get(flavour) == chosen else \
        names.get(chosen, chosen)  # fmt: skip


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
