"""Structured verdicts: `Reason`, `ProbeResult`, `Decision`, `NoBackendError`.

Everything here is plain data with a JSON form (``to_dict``/``from_dict``); formatting for humans
lives in :mod:`te_fl_attention.explain`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import backends

if TYPE_CHECKING:
    from .config import FusedAttnConfig
    from .device import DeviceProfile

#: The steps a reason can come from, in order. ``probe``: the probe itself raised (a bug or an
#: environment problem, never stored or shared); everything after ``rule`` is evidence.
STAGES = ("policy", "probe", "rule", "import", "graph_build", "compile", "run", "numerics",
          "measure")

#: Refusal codes the policy lifts (it reads them here, not from the probes): FA4's preference for
#: an installed FA3 (TE only prefers an enabled FA3), and unfused FP8 when
#: NVTE_UnfusedDPA_Emulate_FP8=1.
FA4_PREFERS_FA3_CODE = "fa4.prefer_fa3"
FP8_EMULATION_CODE = "fp8.unfused"


_new = object.__new__


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class Reason:
    """Why a candidate is refused (or a note on why it was accepted).

    ``code`` is stable (``head_dim.too_large``); ``message`` is a sentence with the observed value
    and the limit; ``stage`` is the step that produced it (see :data:`STAGES`).
    """

    code: str
    message: str
    stage: str = "rule"
    observed: Any = None
    limit: Any = None
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "stage": self.stage,
            "observed": _jsonable(self.observed),
            "limit": _jsonable(self.limit),
            "hint": self.hint,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Reason:
        # str() only where the value is not a str already (it would return it unchanged).
        code = d["code"]
        code = code if type(code) is str else str(code)
        message = d["message"]
        message = message if type(message) is str else str(message)
        stage = d.get("stage", "rule")
        stage = stage if type(stage) is str else str(stage)
        if cls is not Reason:  # a subclass may add fields or checks: use its __init__
            return cls(code=code, message=message, stage=stage, observed=d.get("observed"),
                       limit=d.get("limit"), hint=d.get("hint"))  # fmt: skip
        # The same fields, in the same order, as __init__ sets them (it has no other effects):
        # filling __dict__ directly skips the frozen dataclass's per-field object.__setattr__.
        obj = _new(cls)
        obj.__dict__.update(code=code, message=message, stage=stage, observed=d.get("observed"),
                            limit=d.get("limit"), hint=d.get("hint"))  # fmt: skip
        return obj


@dataclass(frozen=True)
class ProbeResult:
    """One candidate's verdict on one (config, device).

    ``stage`` is the furthest stage reached; ``evidence`` names what decided (``"rules"``,
    ``"cudnn 9.28.1 graph"``...); ``variants`` holds sub-results (the flash-attn flavours).
    """

    backend: str
    supported: bool
    reasons: tuple[Reason, ...] = ()
    stage: str = "rule"
    evidence: str = "rules"
    elapsed_ms: float = 0.0
    detail: Mapping[str, Any] = field(default_factory=dict)
    variants: tuple[ProbeResult, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "supported": self.supported,
            "reasons": [r.to_dict() for r in self.reasons],
            "stage": self.stage,
            "evidence": self.evidence,
            "elapsed_ms": self.elapsed_ms,
            "detail": _jsonable(dict(self.detail)),
            "variants": [v.to_dict() for v in self.variants],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeResult:
        # Converted in __init__'s field order, so a bad value raises what it always raised; a
        # value already of the field's type is taken as is (the conversion would return it).
        backend = d["backend"]
        backend = backend if type(backend) is str else str(backend)
        supported = d["supported"]
        supported = supported if type(supported) is bool else bool(supported)
        reasons = d.get("reasons", ())
        if type(reasons) is not list or reasons:  # () for the usual []
            reasons = tuple(map(Reason.from_dict, reasons))
        else:
            reasons = ()
        stage = d.get("stage", "rule")
        stage = stage if type(stage) is str else str(stage)
        evidence = d.get("evidence", "rules")
        evidence = evidence if type(evidence) is str else str(evidence)
        elapsed_ms = d.get("elapsed_ms", 0.0)
        elapsed_ms = elapsed_ms if type(elapsed_ms) is float else float(elapsed_ms)
        detail = dict(d.get("detail") or {})
        variants = d.get("variants", ())
        if type(variants) is not list or variants:
            variants = tuple(map(cls.from_dict, variants))
        else:
            variants = ()
        if cls is not ProbeResult:  # a subclass may add fields or checks: use its __init__
            return cls(backend=backend, supported=supported, reasons=reasons, stage=stage,
                       evidence=evidence, elapsed_ms=elapsed_ms, detail=detail,
                       variants=variants)  # fmt: skip
        obj = _new(cls)  # see Reason.from_dict
        obj.__dict__.update(backend=backend, supported=supported, reasons=reasons, stage=stage,
                            evidence=evidence, elapsed_ms=elapsed_ms, detail=detail,
                            variants=variants)  # fmt: skip
        return obj

    @property
    def display_name(self) -> str:
        return backends.display(self.backend)

    def chosen_variant(self) -> ProbeResult | None:
        """The flavour a supported multi-flavour candidate would run (``detail['variant']``)."""
        name = self.detail.get("variant")
        return next((v for v in self.variants if v.backend == name), None)


@dataclass(frozen=True)
class Decision:
    """The selector's answer: every candidate's result, the order considered and the winner.

    ``chosen`` is ``None`` when no candidate is supported; ``source`` says where the results came
    from (``probe``, ``memo``, ``cache``).
    """

    config: FusedAttnConfig
    device: DeviceProfile
    chosen: str | None
    results: tuple[ProbeResult, ...]
    policy: Mapping[str, Any] = field(default_factory=dict)
    source: str = "probe"
    order: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)

    def result(self, backend: str) -> ProbeResult:
        for r in self.results:
            if r.backend == backend:
                return r
            for v in r.variants:
                if v.backend == backend:
                    return v
        raise KeyError(f"no result for backend {backend!r}")

    @property
    def chosen_result(self) -> ProbeResult | None:
        return self.result(self.chosen) if self.chosen else None

    @property
    def flash_variant(self) -> str | None:
        """The flash-attn flavour (``fa2``/``fa3``/``fa4``) the policy picked when ``flash`` is
        chosen."""
        return self.detail.get("flash_variant") if self.chosen == "flash" else None

    @property
    def available(self) -> tuple[str, ...]:
        """Every supported candidate, in the policy's order."""
        ok = {r.backend for r in self.results if r.supported}
        return tuple(b for b in self.order if b in ok)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "config_key": self.config.key(),
            "device": self.device.to_dict(),
            "chosen": self.chosen,
            "flash_variant": self.flash_variant,
            "order": list(self.order),
            "results": [r.to_dict() for r in self.results],
            "policy": _jsonable(dict(self.policy)),
            "source": self.source,
            "detail": _jsonable(dict(self.detail)),
        }


def combine_variants(backend: str, variants: tuple[ProbeResult, ...], elapsed_ms: float = 0.0
                     ) -> ProbeResult:  # fmt: skip
    """A multi-flavour candidate's result from its flavours' (in precedence order): supported
    when one is (``detail['variant']`` names the first, ``detail['version']`` its version);
    otherwise every reason once (shared ones first, as each flavour lists them first)."""
    chosen = next((v for v in variants if v.supported), None)
    merged: list[Reason] = []
    if chosen is None:
        seen: set[tuple[str, str]] = set()
        for v in variants:
            for r in v.reasons:
                if (r.code, r.message) not in seen:
                    seen.add((r.code, r.message))
                    merged.append(r)
    return ProbeResult(
        backend=backend,
        supported=chosen is not None,
        reasons=tuple(merged),
        stage="rule",
        evidence="rules",
        elapsed_ms=elapsed_ms,
        detail={
            "variant": chosen.backend if chosen else None,
            "version": chosen.detail.get("version") if chosen else None,
        },
        variants=variants,
    )


class NoBackendError(RuntimeError):
    """No candidate supports the config; the message lists every candidate's reasons."""

    def __init__(self, decision: Decision, message: str | None = None):
        self.decision = decision
        if message is None:
            force = (decision.policy or {}).get("force")
            head = f"no attention backend supports this config on {decision.device.name}"
            if force:
                head += f" (force={force})"
            lines = [head + ":"]
            for r in decision.results:
                for reason in r.reasons:
                    lines.append(f"  {r.display_name}: [{reason.stage}] {reason.message}")
                shown = {(x.code, x.message) for x in r.reasons}
                for v in r.variants:  # a flavour's own reasons (a forced FA3's "not installed")
                    if force in backends.parent() and v.backend != force:
                        continue
                    for reason in v.reasons:
                        if (reason.code, reason.message) not in shown:
                            lines.append(f"  {v.display_name}: [{reason.stage}] "
                                         f"{reason.message}")  # fmt: skip
            message = "\n".join(lines)
        super().__init__(message)
