"""The ``flash`` candidate's probe: each flavour's rules, TE's precedence, then on the local
device the real import and one tiny call."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time

from ... import backends
from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import ProbeResult, Reason, combine_variants
from ..base import Rule, evaluate, reject
from .fa2 import FA2
from .fa3 import FA3
from .fa4 import FA4
from .rules import FLAVOUR_FIELDS, PRECEDENCE, SHARED, version_text

FLAVOUR_RULES: dict[str, tuple[Rule, ...]] = {"fa2": FA2, "fa3": FA3, "fa4": FA4}


@functools.lru_cache(maxsize=8)
def import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (``"ImportError: ..."``), or None; once per process."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken build may raise anything at import
        return f"{type(exc).__name__}: {exc}"
    return None


class FlashAttnProbe:
    """The ``flash`` candidate: one variant result per flavour, TE's precedence among them.

    On the local device a flavour that passes its rules is imported (stage ``import``: a failure
    is a refusal carrying the import error) and, with a CUDA GPU, runs one tiny problem of the
    config's kind (stage ``run``; FA2 gets TE's MLA head-dim padding, see
    :func:`~te_fl_attention.kernels.run.pad_head_dims`; on a GPU the run is isolated in a worker
    process, :mod:`te_fl_attention.run_worker`). ``run=False`` stops after the rules."""

    name = "flash"

    def __init__(self, run: bool = True):
        self.run = run

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list[Reason]:
        """The rule stage's refusals (none when a flavour passes its rules); no import, no run."""
        return list(combine_variants(self.name, self.rule_stage(config, device)).reasons)

    @staticmethod
    def shared(config: FusedAttnConfig, device: DeviceProfile) -> tuple[Reason, ...]:
        """The refusals of the rules TE applies to FlashAttention as a whole."""
        return tuple(evaluate(SHARED, config, device))

    def rule_variant(self, flavour: str, config: FusedAttnConfig, device: DeviceProfile,
                     shared: tuple[Reason, ...] | None = None) -> ProbeResult:  # fmt: skip
        """``flavour``'s rule-stage result (the shared rules, then its own); ``shared``: the
        shared rules' refusals, when already known."""
        if shared is None:
            shared = self.shared(config, device)
        return self._rule_variant(flavour, config, device, list(shared), FLAVOUR_RULES[flavour])

    def rule_stage(self, config: FusedAttnConfig, device: DeviceProfile
                   ) -> tuple[ProbeResult, ...]:  # fmt: skip
        """Each flavour's rule-stage result, in TE's precedence."""
        shared = self.shared(config, device)
        return tuple(self.rule_variant(f, config, device, shared) for f in PRECEDENCE)

    @staticmethod
    def _rule_variant(flavour: str, config: FusedAttnConfig, device: DeviceProfile,
                      shared: list[Reason], rules: tuple[Rule, ...],
                      own: list[Reason] | None = None) -> ProbeResult:  # fmt: skip
        """The flavour's rule-stage result; ``own``: its rules' refusals, when already known."""
        if own is None:
            own = evaluate(rules, config, device)
        return ProbeResult(
            backend=flavour,
            supported=not shared and not own,
            reasons=tuple(shared + own),
            stage="import" if own and own[0].stage == "import" else "rule",
            evidence="rules",
            detail={"version": version_text(flavour, device.version(FLAVOUR_FIELDS[flavour]))},
        )

    def variant(self, flavour: str, config: FusedAttnConfig, device: DeviceProfile,
                shared: list[Reason]) -> ProbeResult:  # fmt: skip
        result = self._rule_variant(flavour, config, device, shared, FLAVOUR_RULES[flavour])
        return self._after_rules(result, config, device)

    def _after_rules(self, result: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
                     ) -> ProbeResult:  # fmt: skip
        if result.supported and self.run and device.source == "local":
            return self._local(result.backend, config, result)
        return result

    def narrow(self, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
               ) -> ProbeResult | None:  # fmt: skip
        """A cached ``flash`` result under this process's rules, flavour by flavour: a flavour
        ``cached`` claims supported and the local rules refuse gets their refusal; the others
        keep their cached result (it may only refuse more); the candidate is supported when a
        flavour is. ``None``: ``cached`` is not a flash result as this probe writes it (one
        variant per flavour, supported when one is): probe again."""
        if cached.backend != self.name:
            return None
        variants = cached.variants
        if tuple([v.backend for v in variants]) != PRECEDENCE:
            return None  # not what this probe writes: probe again
        # a flavour refused in cache stays refused; one claimed supported must pass our rules
        out, changed, supported = [], False, False
        for v in variants:
            if v.supported:
                supported = True
                n = self._narrow_variant(v, config, device)
                changed = changed or n is not v
                v = n
            out.append(v)
        if supported != cached.supported:
            return None  # not what this probe writes (supported when a flavour is): probe again
        return combine_variants(self.name, tuple(out), cached.elapsed_ms) if changed else cached

    def _local(self, flavour: str, config: FusedAttnConfig, result: ProbeResult) -> ProbeResult:
        """The import and tiny-run stages on this machine."""
        from ...kernels import run as runner

        dist, module = runner.FLASH_MODULES[flavour]
        name = backends.display(flavour)
        err = import_error(module)
        if err is not None:
            why = reject(f"{flavour}.import_failed", f"{name} ({dist} "
                         f"{result.detail.get('version')}) is installed but {module} cannot be "
                         f"imported: {err}"[:2000], observed=err[:300], limit=f"import {module}",
                         stage="import", hint=f"reinstall {dist} for this torch/CUDA")  # fmt: skip
            return dataclasses.replace(result, supported=False, reasons=(why,), stage="import")
        import torch

        if not torch.cuda.is_available():
            return dataclasses.replace(result, stage="import", evidence=f"import {module}",
                                       detail={**result.detail, "run_note": "no CUDA device: "
                                               "the tiny call was not run"})  # fmt: skip
        from ... import problems

        note, exc = problems.tiny_run(flavour, config)  # gpu-only
        if exc is not None:  # gpu-only
            error = problems.describe_error(exc)
            why = reject(f"{flavour}.run_failed", f"{name} failed on a tiny problem: {error}",
                         observed=problems.error_type(exc), limit="runs without error",
                         stage="run")  # fmt: skip
            return dataclasses.replace(result, supported=False, reasons=(why,), stage="run")
        detail = {**result.detail, **({"run_note": note} if note else {})}  # gpu-only
        return dataclasses.replace(result, stage="run" if note is None else "import",  # gpu-only
                                   evidence=f"import {module}" + ("" if note else " + tiny run"),
                                   detail=detail)  # fmt: skip

    def _narrow_variant(self, cached: ProbeResult, config: FusedAttnConfig,
                        device: DeviceProfile) -> ProbeResult:  # fmt: skip
        """``cached`` (a flavour claimed supported) when the local rules pass it, else their
        refusal (:meth:`rule_variant`'s result). The passing case builds no result."""
        flavour = cached.backend
        rules = FLAVOUR_RULES.get(flavour)
        if rules is None:  # not a flavour of ours
            return self.rule_variant(flavour, config, device)
        shared = self.shared(config, device)
        if not shared:
            own = evaluate(rules, config, device)
            if not own:
                return cached
            local = self._rule_variant(flavour, config, device, [], rules, own)
        else:
            local = self.rule_variant(flavour, config, device, shared)
        return cached if local.supported else local

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        t0 = time.perf_counter()
        if not self.run or device.source != "local":  # the rule stage is the verdict
            rules = self.rule_stage(config, device)
            return combine_variants(self.name, rules, (time.perf_counter() - t0) * 1e3)
        variants = tuple(self._after_rules(r, config, device)
                         for r in self.rule_stage(config, device))  # fmt: skip
        return combine_variants(self.name, variants, (time.perf_counter() - t0) * 1e3)
