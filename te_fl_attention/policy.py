"""Everything a user can say about the choice: NVTE_* switches, forcing, preferring, ordering.

Environment variables are read with ``os.environ.get`` (torch.compile guards those reads): TE's
``NVTE_*`` exactly as TE 2.20.2 parses them, ours (``TE_FL_ATTN_*``) exactly ``0``/``1`` (see
:mod:`te_fl_attention.switches`).
The policy never probes; it filters probe results and orders the survivors. ``verify`` and
``measure`` ask the selector for two extra stages (numerical verification, timing); with timings,
the policy orders the timed candidates fastest first.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .reasons import (
    BACKENDS,
    FA4_PREFERS_FA3_CODE,
    FLASH_FLAVOURS,
    FP8_EMULATION_CODE,
    ProbeResult,
    Reason,
)
from .switches import check_switches, nvte_emulate_fp8, nvte_int, switch

#: Names accepted by ``force=``/``prefer()`` -> canonical candidate or flash flavour.
ALIASES = {
    "fused": "fused", "cudnn": "fused", "fusedattention": "fused",
    "flash": "flash", "flashattention": "flash", "flash_attn": "flash",
    "fa2": "fa2", "fa3": "fa3", "fa4": "fa4",
    "flash_attn_2": "fa2", "flash_attn_3": "fa3", "flash_attn_4": "fa4",
    "triton": "triton", "tritonflash": "triton", "tritonflashattention": "triton",
    "unfused": "unfused", "unfuseddotproductattention": "unfused", "reference": "unfused",
}  # fmt: skip

#: Every variable a policy reads (os.environ.get, so torch.compile guards them).
ENV_VARS = (
    "NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V2", "NVTE_FLASH_ATTN_V3", "NVTE_FLASH_ATTN_V4",
    "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_UnfusedDPA_Emulate_FP8", "TE_FL_ATTN_TRITON",
    "TE_FL_ATTN_FORCE", "TE_FL_ATTN_PREFER", "TE_FL_ATTN_VERIFY", "TE_FL_ATTN_MEASURE",
)  # fmt: skip
_FROM_ENV: dict[tuple, Policy] = {}
_PREFER: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("prefer", default=())


def canonical(name: str) -> str:
    """Canonical candidate/flavour name; unknown names raise (never silently ignored)."""
    key = name.strip().lower().replace("-", "_").replace(" ", "")
    if key not in ALIASES:
        raise ValueError(f"backend={name!r} is not known; allowed: {', '.join(sorted(ALIASES))}")
    return ALIASES[key]


def _flag(environ: Mapping[str, str], var: str, default: str = "1") -> bool:
    """A switch as its owner parses it: TE's ``NVTE_*`` as TE 2.20.2 does (``int()``), ours
    exactly ``0``/``1`` (:mod:`te_fl_attention.switches`)."""
    if var == "NVTE_UnfusedDPA_Emulate_FP8":
        return nvte_emulate_fp8(environ)
    if var.startswith("NVTE_"):
        return nvte_int(var, environ, default)
    return switch(var, environ)


def _candidate(name: str) -> str:
    return "flash" if name in FLASH_FLAVOURS else name


@dataclass(frozen=True)
class Policy:
    """A snapshot of the user's wishes. Hashable: it is part of the selector's memo key."""

    flash: bool = True
    fa2: bool = True
    fa3: bool = True
    fa4: bool = True
    fused: bool = True
    unfused: bool = True
    triton: bool = True
    unfused_fp8_emulation: bool = False
    force: str | None = None
    prefer: tuple[str, ...] = ()
    verify: bool = False
    measure: bool = False

    def __post_init__(self) -> None:
        if self.force is not None:
            object.__setattr__(self, "force", canonical(self.force))
        object.__setattr__(self, "prefer", tuple(canonical(p) for p in self.prefer))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Policy:
        """Read TE's switches (NVTE_FLASH_ATTN[_V2/_V3/_V4], NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN,
        NVTE_UnfusedDPA_Emulate_FP8) and ours (TE_FL_ATTN_TRITON, TE_FL_ATTN_FORCE,
        TE_FL_ATTN_PREFER, TE_FL_ATTN_VERIFY, TE_FL_ATTN_MEASURE), plus any active
        :func:`prefer` context. Parsed policies are reused for identical raw values, so the
        per-call cost is the env reads."""
        env = os.environ if environ is None else environ
        raw = (*(env.get(v) for v in ENV_VARS), _PREFER.get())
        if not overrides:
            hit = _FROM_ENV.get(raw)
            if hit is not None:
                return hit
        values = {k: v for k, v in zip(ENV_VARS, raw[:-1], strict=True) if v is not None}
        flash = _flag(values, "NVTE_FLASH_ATTN")
        prefer = tuple(p for p in values.get("TE_FL_ATTN_PREFER", "").split(",") if p.strip())
        kw: dict[str, object] = dict(
            flash=flash,
            fa2=flash and _flag(values, "NVTE_FLASH_ATTN_V2"),
            fa3=flash and _flag(values, "NVTE_FLASH_ATTN_V3"),
            fa4=flash and _flag(values, "NVTE_FLASH_ATTN_V4"),
            fused=_flag(values, "NVTE_FUSED_ATTN"),
            unfused=_flag(values, "NVTE_UNFUSED_ATTN"),
            triton=_flag(values, "TE_FL_ATTN_TRITON") and flash,
            unfused_fp8_emulation=_flag(values, "NVTE_UnfusedDPA_Emulate_FP8", "0"),
            force=values.get("TE_FL_ATTN_FORCE") or None,
            prefer=raw[-1] + prefer,
            verify=_flag(values, "TE_FL_ATTN_VERIFY", "0"),
            measure=_flag(values, "TE_FL_ATTN_MEASURE", "0"),
        )
        kw.update(overrides)
        policy = cls(**kw)  # type: ignore[arg-type]
        if not overrides:
            if len(_FROM_ENV) > 256:
                _FROM_ENV.clear()
            _FROM_ENV[raw] = policy
        return policy

    def with_(self, **changes: object) -> Policy:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        """The policy as a plain dict (computed once: the policy is frozen)."""
        cached = self.__dict__.get("_dict")
        if cached is None:
            cached = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            object.__setattr__(self, "_dict", cached)
        return dict(cached)

    # ------------------------------------------------------------------ filtering
    def _disabled(self, name: str) -> Reason | None:
        if getattr(self, name):
            return None
        var = {
            "flash": "NVTE_FLASH_ATTN=0",
            "fa2": "NVTE_FLASH_ATTN=0 or NVTE_FLASH_ATTN_V2=0",
            "fa3": "NVTE_FLASH_ATTN=0 or NVTE_FLASH_ATTN_V3=0",
            "fa4": "NVTE_FLASH_ATTN=0 or NVTE_FLASH_ATTN_V4=0",
            "fused": "NVTE_FUSED_ATTN=0",
            "unfused": "NVTE_UNFUSED_ATTN=0",
            "triton": "NVTE_FLASH_ATTN=0 or TE_FL_ATTN_TRITON=0",
        }[name]
        return Reason(f"policy.{name}_disabled", f"disabled by {var}", "policy",
                      observed="0", limit="1", hint=f"unset {var.split(' or ')[-1]}")  # fmt: skip

    def _waived(self) -> frozenset[str]:
        """Reason codes this policy lifts: NVTE_UnfusedDPA_Emulate_FP8=1 lifts unfused's FP8
        refusal; with FA3 disabled, TE no longer drops FA4 "to prefer FA3" on sm90."""
        codes = set()
        if self.unfused_fp8_emulation:
            codes.add(FP8_EMULATION_CODE)
        if not self.fa3:
            codes.add(FA4_PREFERS_FA3_CODE)
        return frozenset(codes)

    @staticmethod
    def _waive(result: ProbeResult, codes: frozenset[str]) -> ProbeResult:
        if not codes or not any(r.code in codes for r in result.reasons):
            return result
        kept = tuple(r for r in result.reasons if r.code not in codes)
        return dataclasses.replace(result, reasons=kept, supported=not kept)

    def filter(self, result: ProbeResult) -> ProbeResult:
        """The result as this policy sees it: env-disabled candidates refused (stage policy)."""
        waived = self._waived()
        result = self._waive(result, waived)
        if result.backend == "flash":
            variants = []
            for v in result.variants:
                v = self._waive(v, waived)
                why = self._disabled(v.backend)
                if why is None and self.force in FLASH_FLAVOURS and v.backend != self.force:
                    why = Reason("policy.not_forced", f"force={self.force} excludes {v.backend}",
                                 "policy", observed=v.backend, limit=self.force)  # fmt: skip
                variants.append(dataclasses.replace(v, supported=False, reasons=(why, *v.reasons))
                                if why else v)  # fmt: skip
            supported = any(v.supported for v in variants)
            why = self._disabled("flash")
            if why:
                reasons: tuple[Reason, ...] = (why, *result.reasons)
            elif supported:
                reasons = ()
            else:  # every flavour refused: keep the probe's reasons, add the policy's own;
                # a forced flavour's own reasons first (why *it* cannot run)
                forced = [x for v in variants if v.backend == self.force for x in v.reasons
                          if x.code != "policy.not_forced"]  # fmt: skip
                extra = [v.reasons[0] for v in variants if v.reasons and v.reasons[0].stage
                         == "policy" and v.backend != self.force]  # fmt: skip
                reasons = _unique((*forced, *extra, *result.reasons))
            return dataclasses.replace(result, supported=supported and why is None,
                                       reasons=reasons, variants=tuple(variants))  # fmt: skip
        why = self._disabled(result.backend)
        if why:
            return dataclasses.replace(result, supported=False, reasons=(why, *result.reasons))
        return result

    # ------------------------------------------------------------------ ordering
    def order(self, sm: int | None, timings: Mapping[str, float] | None = None
              ) -> tuple[str, ...]:  # fmt: skip
        """TE's priority (sm >= 90: fused > flash > unfused; else flash > fused > unfused) with
        Triton after flash-attn in the flash tier; preferred names first; a forced one alone.
        With ``timings`` (measured mode: candidate -> ms), the timed candidates trade places among
        their own slots, fastest first; an untimed candidate keeps its slot (rules decide)."""
        if self.force is not None:
            return (_candidate(self.force),)
        base = ["fused", "flash", "triton", "unfused"] if (sm or 0) >= 90 else \
            ["flash", "triton", "fused", "unfused"]  # fmt: skip
        front = []
        for p in self.prefer:
            c = _candidate(p)
            if c not in front:
                front.append(c)
        rest = [b for b in base if b not in front]
        times = timings or {}
        ranked = iter(sorted((b for b in rest if b in times), key=lambda b: times[b]))
        return tuple(front + [next(ranked) if b in times else b for b in rest])

    def flavour(self, flash: ProbeResult, timings: Mapping[str, float] | None = None
                ) -> str | None:  # fmt: skip
        """Which supported flash-attn flavour runs: a forced/preferred one, else the fastest timed
        one (measured mode), else FA4 > FA3 > FA2."""
        wanted = [n for n in ((self.force,) if self.force else self.prefer)
                  if n in FLASH_FLAVOURS]  # fmt: skip
        ok = {v.backend for v in flash.variants if v.supported}
        fastest = sorted((n for n in ok if n in (timings or {})),
                         key=lambda n: timings[n])  # type: ignore[index]  # fmt: skip
        for name in (*wanted, *fastest, "fa4", "fa3", "fa2"):
            if name in ok:
                return name
        return None


@contextlib.contextmanager
def prefer(*names: str) -> Iterator[None]:
    """Prefer these backends (in order) inside the block: ``with prefer("triton"): ...``."""
    canon = tuple(canonical(n) for n in names)
    token = _PREFER.set(canon + _PREFER.get())
    try:
        yield
    finally:
        _PREFER.reset(token)


__all__ = ["Policy", "prefer", "canonical", "BACKENDS", "switch", "nvte_int", "check_switches"]


def _unique(reasons: tuple[Reason, ...]) -> tuple[Reason, ...]:
    """``reasons`` without repeats, in order; by equality, not hash (a reason read back from
    JSON may hold a list in ``observed``/``limit``)."""
    out: list[Reason] = []
    for r in reasons:
        if r not in out:
            out.append(r)
    return tuple(out)
