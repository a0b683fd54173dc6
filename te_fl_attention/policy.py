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
import operator
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from . import backends
from .frozen import hash_once
from .reasons import FA4_PREFERS_FA3_CODE, FP8_EMULATION_CODE, ProbeResult, Reason
from .switches import check_switches, nvte_emulate_fp8, nvte_int, switch

#: What a policy reads besides the backends' own switches (``backends.switch_vars()``).
OTHER_VARS = ("NVTE_UnfusedDPA_Emulate_FP8", "TE_FL_ATTN_FORCE", "TE_FL_ATTN_PREFER",
              "TE_FL_ATTN_VERIFY", "TE_FL_ATTN_MEASURE")  # fmt: skip
_FROM_ENV: dict[tuple, Policy] = {}
_PREFER: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("prefer", default=())
_ENV: dict[str, object] = {"version": None}


def env_vars() -> tuple[str, ...]:
    """Every variable a policy reads (with ``os.environ.get``, so torch.compile guards them): the
    registered backends' switches, then :data:`OTHER_VARS`."""
    if _ENV["version"] != backends.version():
        names = (*backends.switch_vars(), *OTHER_VARS)
        _ENV.update(version=backends.version(), names=names,
                    bkeys=tuple(os.fsencode(k) for k in names))  # fmt: skip
        _ENV["get"] = operator.itemgetter(*_ENV["bkeys"])  # type: ignore[misc]
        _ENV["all_set"] = True  # the last read found every variable set
    return _ENV["names"]  # type: ignore[return-value]


def __getattr__(name: str) -> object:
    if name == "ENV_VARS":  # what the built-in backends and any registered since read
        return env_vars()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ENVIRON = os.environ
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
if type(_ENV_DATA) is not dict:
    _ENV_DATA = None


def snapshot() -> tuple:
    """The raw environment a policy is parsed from (every :func:`env_vars` value, ``None`` when
    unset) and the active :func:`prefer` context: hashable, the key under which parsed policies
    are kept. On POSIX CPython this reads ``os.environ``'s backing dict directly (10x cheaper
    than ``os.environ.get``; one C call when every variable is set, as the plugin seeds them);
    the values are then bytes, which :meth:`Policy.from_snapshot` decodes. When the last read
    found a variable unset, the next reads each with ``dict.get`` (no KeyError raised and
    caught per call) until one finds them all set."""
    names = env_vars()
    if _ENV_DATA is not None and os.environ is _ENVIRON:
        if _ENV["all_set"]:
            try:
                return (_ENV["get"](_ENV_DATA), _PREFER.get())  # type: ignore[operator]
            except KeyError:
                _ENV["all_set"] = False
        values = tuple(map(_ENV_DATA.get, _ENV["bkeys"]))  # type: ignore[arg-type]
        if None not in values:
            _ENV["all_set"] = True
        return (values, _PREFER.get())
    return (tuple(map(os.environ.get, names)), _PREFER.get())


def canonical(name: str) -> str:
    """Canonical candidate/flavour name; unknown names raise (never silently ignored)."""
    key = name.strip().lower().replace("-", "_").replace(" ", "")
    names = backends.aliases()
    if key not in names:
        raise ValueError(f"backend={name!r} is not known; allowed: {', '.join(sorted(names))}")
    return names[key]


def __dir__() -> list[str]:
    return [*globals(), "ENV_VARS"]


def _flag(environ: Mapping[str, str], var: str, default: str = "1") -> bool:
    """A switch as its owner parses it: TE's ``NVTE_*`` as TE 2.20.2 does (``int()``), ours
    exactly ``0``/``1`` (:mod:`te_fl_attention.switches`)."""
    if var == "NVTE_UnfusedDPA_Emulate_FP8":
        return nvte_emulate_fp8(environ)
    if var.startswith("NVTE_"):
        return nvte_int(var, environ, default)
    return switch(var, environ)


def _candidate(name: str) -> str:
    return backends.parent().get(name, name)


@hash_once
@dataclass(frozen=True)
class Policy:
    """A snapshot of the user's wishes. Hashable: it is part of the selector's memo key.

    ``off``: the candidates and flavours switched off (``Policy(fused=False)``,
    ``policy.fused`` and ``with_(fa3=False)`` read and write it by name, for every registered
    backend and flavour)."""

    off: frozenset[str] = frozenset()
    unfused_fp8_emulation: bool = False
    force: str | None = None
    prefer: tuple[str, ...] = ()
    verify: bool = False
    measure: bool = False

    def __init__(self, off: Iterable[str] = (), unfused_fp8_emulation: bool = False,
                 force: str | None = None, prefer: Iterable[str] = (), verify: bool = False,
                 measure: bool = False, **units: bool) -> None:  # fmt: skip
        known = backends.units()
        bad = sorted(set(off) - set(known)) or sorted(set(units) - set(known))
        if bad:
            raise TypeError(f"Policy: {', '.join(bad)} is not a backend or flavour; known: "
                            f"{', '.join(known)}")  # fmt: skip
        disabled = set(off)
        for name, on in units.items():
            (disabled.discard if on else disabled.add)(name)
        setattr_ = object.__setattr__
        setattr_(self, "off", frozenset(disabled))
        setattr_(self, "unfused_fp8_emulation", bool(unfused_fp8_emulation))
        setattr_(self, "force", None if force is None else canonical(force))
        setattr_(self, "prefer", tuple(canonical(p) for p in prefer))
        setattr_(self, "verify", bool(verify))
        setattr_(self, "measure", bool(measure))
        # nothing off, forced or waived: filter() returns every result as it is
        setattr_(self, "_plain", not self.off and self.force is None and not self._waived())

    def __getattr__(self, name: str) -> bool:
        """``policy.fa3``: whether that candidate or flavour is on."""
        if not name.startswith("_") and name in backends.units():
            return name not in self.off
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Policy:
        """Read TE's switches (NVTE_FLASH_ATTN[_V2/_V3/_V4], NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN,
        NVTE_UnfusedDPA_Emulate_FP8), ours (TE_FL_ATTN_TRITON, TE_FL_ATTN_FORCE,
        TE_FL_ATTN_PREFER, TE_FL_ATTN_VERIFY, TE_FL_ATTN_MEASURE) and every registered
        backend's switch, plus any active :func:`prefer` context. Parsed policies are reused
        for identical raw values, so the per-call cost is the env reads."""
        if environ is None:
            snap = snapshot()
        else:
            snap = (tuple(map(environ.get, env_vars())), _PREFER.get())
        policy = cls.from_snapshot(snap)
        return policy.with_(**overrides) if overrides else policy

    @classmethod
    def from_snapshot(cls, snap: tuple) -> Policy:
        """The policy a :func:`snapshot` describes (parsed once per distinct snapshot)."""
        hit = _FROM_ENV.get(snap)
        if hit is not None:
            return hit
        names = env_vars()
        values = {k: os.fsdecode(v) if isinstance(v, bytes) else v
                  for k, v in zip(names, snap[0], strict=True) if v is not None}  # fmt: skip
        for var in backends.switch_vars():  # ours: every value checked, read or not
            if not var.startswith("NVTE_"):
                switch(var, values)
        off = [u for u in backends.units()  # TE's: read in order, as TE reads them
               if not all(_flag(values, v) for v in backends.switches(u))]
        prefer = tuple(p for p in values.get("TE_FL_ATTN_PREFER", "").split(",") if p.strip())
        policy = cls(
            off=off,
            unfused_fp8_emulation=_flag(values, "NVTE_UnfusedDPA_Emulate_FP8", "0"),
            force=values.get("TE_FL_ATTN_FORCE") or None,
            prefer=snap[1] + prefer,
            verify=_flag(values, "TE_FL_ATTN_VERIFY", "0"),
            measure=_flag(values, "TE_FL_ATTN_MEASURE", "0"),
        )
        if len(_FROM_ENV) > 256:
            _FROM_ENV.clear()
        _FROM_ENV[snap] = policy
        return policy

    def with_(self, **changes: object) -> Policy:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        """The policy as a plain dict: each candidate and flavour on or off, then the rest
        (computed once: the policy is frozen)."""
        cached = self.__dict__.get("_dict")
        if cached is None:
            cached = {u: u not in self.off for u in backends.units()}
            cached.update(unfused_fp8_emulation=self.unfused_fp8_emulation, force=self.force,
                          prefer=self.prefer, verify=self.verify, measure=self.measure)
            object.__setattr__(self, "_dict", cached)
        return dict(cached)

    # ------------------------------------------------------------------ filtering
    def _disabled(self, name: str) -> Reason | None:
        if name not in self.off:
            return None
        var = " or ".join(f"{v}=0" for v in backends.switches(name)) if name in \
            backends.units() else "the policy"  # fmt: skip
        return Reason(f"policy.{name}_disabled", f"disabled by {var}", "policy",
                      observed="0", limit="1", hint=f"unset {var.split(' or ')[-1]}")  # fmt: skip

    def _waived(self) -> frozenset[str]:
        """Reason codes this policy lifts: NVTE_UnfusedDPA_Emulate_FP8=1 lifts unfused's FP8
        refusal; with FA3 disabled, TE no longer drops FA4 "to prefer FA3" on sm90. (Computed
        once: the policy is frozen.)"""
        cached = self.__dict__.get("_waived_codes")
        if cached is None:
            codes = set()
            if self.unfused_fp8_emulation:
                codes.add(FP8_EMULATION_CODE)
            if "fa3" in self.off:
                codes.add(FA4_PREFERS_FA3_CODE)
            cached = frozenset(codes)
            object.__setattr__(self, "_waived_codes", cached)
        return cached

    @staticmethod
    def _waive(result: ProbeResult, codes: frozenset[str]) -> ProbeResult:
        if not codes or not any(r.code in codes for r in result.reasons):
            return result
        kept = tuple(r for r in result.reasons if r.code not in codes)
        return dataclasses.replace(result, reasons=kept, supported=not kept)

    def filter(self, result: ProbeResult) -> ProbeResult:
        """The result as this policy sees it: env-disabled candidates refused (stage policy)."""
        if self._plain:
            return result
        waived = self._waived()
        result = self._waive(result, waived)
        if result.variants:
            variants = []
            forced_flavour = _candidate(self.force or "") == result.backend != self.force
            for v in result.variants:
                v = self._waive(v, waived)
                why = self._disabled(v.backend)
                if why is None and forced_flavour and v.backend != self.force:
                    why = Reason("policy.not_forced", f"force={self.force} excludes {v.backend}",
                                 "policy", observed=v.backend, limit=self.force)  # fmt: skip
                variants.append(dataclasses.replace(v, supported=False, reasons=(why, *v.reasons))
                                if why else v)  # fmt: skip
            why = self._disabled(result.backend)
            if why is None and not forced_flavour and all(
                    a is b for a, b in zip(variants, result.variants, strict=True)):
                return result  # nothing for the policy to change
            supported = any(v.supported for v in variants)
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
        base = backends.priority(sm)
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
        """Which supported flavour of a multi-flavour candidate (flash-attn) runs: a
        forced/preferred one, else the fastest timed one (measured mode), else the registry's
        precedence (FA4 > FA3 > FA2)."""
        order = backends.precedence(flash.backend)
        ok = {v.backend for v in flash.variants if v.supported}
        wanted = [n for n in ((self.force,) if self.force else self.prefer) if n in order]
        fastest = sorted((n for n in ok if n in timings),
                         key=timings.__getitem__) if timings else ()  # fmt: skip
        for name in (*wanted, *fastest, *order):
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


__all__ = ["Policy", "prefer", "canonical", "env_vars", "snapshot", "switch", "nvte_int",
           "check_switches"]  # fmt: skip


def _unique(reasons: tuple[Reason, ...]) -> tuple[Reason, ...]:
    """``reasons`` without repeats, in order; by equality, not hash (a reason read back from
    JSON may hold a list in ``observed``/``limit``)."""
    out: list[Reason] = []
    for r in reasons:
        if r not in out:
            out.append(r)
    return tuple(out)
