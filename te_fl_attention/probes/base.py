"""The probe protocol and the declarative rule machinery every candidate shares.

A rule is a small function ``(config, device) -> Reason | None`` whose docstring names the
TransformerEngine behaviour it mirrors. A probe runs its rules (the fast pre-filter, stage
``rule``) and then, in later stages, the real thing (graph build, compile, run).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from packaging.version import InvalidVersion, Version

from ..config import FusedAttnConfig
from ..device import DeviceProfile
from ..reasons import ProbeResult, Reason

Rule = Callable[[FusedAttnConfig, DeviceProfile], "Reason | None"]



class Probe(Protocol):
    """One candidate backend: cheap rules first, then the real probe."""

    name: str

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list[Reason]: ...

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult: ...


def reject(code: str, message: str, *, observed: object = None, limit: object = None,
           hint: str | None = None, stage: str = "rule") -> Reason:  # fmt: skip
    """A refusal produced by a rule (stage ``rule`` unless said otherwise)."""
    return Reason(code, message, stage, observed, limit, hint)


def evaluate(rules: Iterable[Rule], config: FusedAttnConfig, device: DeviceProfile
             ) -> list[Reason]:  # fmt: skip
    """Run every rule; return all refusals in rule order (TE stops at none either)."""
    return [reason for rule in rules if (reason := rule(config, device)) is not None]


@functools.lru_cache(maxsize=256)
def version(text: str | None) -> Version | None:
    """Parse a version string; ``None`` for missing or unparsable ones."""
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def cudnn_version(device: DeviceProfile) -> tuple[int, int, int] | None:
    """cuDNN as TE compares it: ``(major, minor, patch)``."""
    return _cudnn_triple(device.cudnn)


@functools.lru_cache(maxsize=256)
def _cudnn_triple(text: str | None) -> tuple[int, int, int] | None:
    v = version(text)
    if v is None:
        return None
    rel = (*v.release, 0, 0)
    return (rel[0], rel[1], rel[2])


def fmt_version(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def no_gpu(name: str) -> Rule:
    """A rule refusing when the device has no CUDA GPU (sm unknown)."""

    def requires_gpu(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        """Every CUDA backend needs a GPU; TE reads the compute capability of the current one."""
        if d.sm is None:
            return reject(
                "device.no_gpu",
                f"{name} needs a CUDA GPU; {d.name} has none",
                observed=None,
                limit="CUDA GPU",
                hint="pick a GPU profile with --device (e.g. h100) for a what-if answer",
            )
        return None

    return requires_gpu


class RuleProbe:
    """A probe whose verdict is its rule stage (later issues add real stages after the rules)."""

    name: str = ""
    RULES: Sequence[Rule] = ()

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list[Reason]:
        return evaluate(self.RULES, config, device)

    def narrow(self, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
               ) -> ProbeResult | None:  # fmt: skip
        """``cached`` (a result from the probe cache: another process, an import, Redis) as this
        process's rule stage allows it: where the local rules refuse, their refusal, whatever
        ``cached`` claims; else ``cached`` (it may only refuse more). ``None``: ``cached`` is not
        a result of this candidate (probe again)."""
        if cached.backend != self.name:
            return None
        t0 = time.perf_counter()
        reasons = self.rules(config, device)
        return self._rule_result(reasons, t0) if reasons else cached

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        t0 = time.perf_counter()
        return self._rule_result(self.rules(config, device), t0)

    def _rule_result(self, reasons: list[Reason], t0: float) -> ProbeResult:
        """The rule stage's result from its refusals (``t0``: when the rules started)."""
        return ProbeResult(
            backend=self.name,
            supported=not reasons,
            reasons=tuple(reasons),
            stage=reasons[0].stage if reasons else "rule",
            evidence="rules",
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
        )
