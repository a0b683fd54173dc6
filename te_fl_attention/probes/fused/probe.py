"""The ``fused`` candidate's probe: the binding rules, the table's prediction, then cuDNN itself
building the graph in the probe worker."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import ProbeResult, Reason
from ..base import (
    RuleProbe,
    cudnn_version,
    evaluate,
    fmt_version,
    reject,
    version,
)
from .cp import cp_steps
from .cpp import BINDING_RULES
from .rules import fused_sub_backend
from .table import TABLE_RULES


class CudnnProbe(RuleProbe):
    """The ``fused`` candidate: TE's Python filters and its C++ query's pre-graph refusals
    (binding), the prediction of cuDNN's verdict, then, with ``graph=True``, cuDNN itself builds
    the graph (:mod:`.graph`, deviceless for catalog GPUs). cuDNN's verdict replaces the
    prediction; a disagreement is recorded in ``detail["rule_drift"]``. Without cudnn-frontend,
    or for a cuDNN version other than the installed one, the prediction stands, marked
    ``detail["predicted"]``."""

    name = "fused"
    RULES = (*BINDING_RULES, *TABLE_RULES)

    def __init__(self, graph: bool = False, timeout_s: float = 60.0):
        self.graph = graph
        self.timeout_s = timeout_s

    @staticmethod
    def binding(config: FusedAttnConfig, device: DeviceProfile) -> tuple[Reason, ...]:
        """The binding refusals (TE's Python filters, its C++ query, determinism)."""
        return tuple(evaluate(BINDING_RULES, config, device))

    @staticmethod
    def predicted(config: FusedAttnConfig, device: DeviceProfile) -> tuple[Reason, ...]:
        """The support table's predicted refusals (not binding)."""
        return tuple(evaluate(TABLE_RULES, config, device))

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list[Reason]:
        return [*self.binding(config, device), *self.predicted(config, device)]

    def narrow(self, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
               ) -> ProbeResult | None:  # fmt: skip
        """A cached result under this process's binding rules: where they refuse, the rule
        stage's own refusal (as :meth:`probe` gives it), whatever ``cached`` claims; else
        ``cached`` (it may only refuse more). The table's predictions do not bind: cuDNN's
        cached verdict stands over them. ``None``: not a fused result (probe again)."""
        if cached.backend != self.name:
            return None
        binding = self.binding(config, device)
        return self._probe(config, device, binding) if binding else cached

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        return self._probe(config, device, self.binding(config, device))

    def _probe(self, config: FusedAttnConfig, device: DeviceProfile,
               binding: tuple[Reason, ...]) -> ProbeResult:  # fmt: skip
        """The verdict given the binding refusals (the rule stage decides when there are any,
        or when no graph is built)."""
        t0 = time.perf_counter()
        predicted = self.predicted(config, device)
        detail: dict[str, Any] = {"sub_backend": fused_sub_backend(config), "cudnn": device.cudnn}
        answer, note = (None, None)
        if not binding and self.graph:
            answer, note = self._ask_cudnn(config, device)
        if answer is None or not answer.get("decided"):
            reasons = (*binding, *predicted)
            detail["predicted"] = not binding  # the verdict rests on the table's prediction
            if note is not None:
                detail["graph_note"] = note.message
            steps = cp_steps(config)
            if steps:  # context parallelism: the per-step queries the table answered
                detail["cp_steps"] = [s.to_dict() for s in steps]
            return ProbeResult(
                backend=self.name, supported=not reasons, reasons=tuple(reasons),
                stage=reasons[0].stage if reasons else "rule", evidence="rules",
                elapsed_ms=(time.perf_counter() - t0) * 1e3,
                detail=detail if not reasons else {k: v for k, v in detail.items()
                                                   if k in ("predicted", "cp_steps")},
            )  # fmt: skip
        ok = bool(answer["supported"])
        detail.update(
            plans=answer.get("plans") or {}, heur_mode=answer.get("heur_mode"),
            cudnn=answer.get("cudnn_version"), mode=answer.get("mode"),
        )  # fmt: skip
        if answer.get("cp_steps"):  # context parallelism: each step's own query and verdict
            detail["cp_steps"] = answer["cp_steps"]
        cp_step = answer.get("cp_step")
        # What a local answer rests on: the captured descriptor, real handle or not.
        if device.source == "local":  # gpu-only
            detail.update(descriptor=answer.get("descriptor"),
                          graph_notes=list(answer.get("notes") or []))  # fmt: skip
        if ok == bool(predicted):  # the table predicted the opposite of cuDNN's answer
            detail["rule_drift"] = {
                "rules": "refused" if predicted else "accepted",
                "cudnn": "accepted" if ok else "refused",
                "rule_codes": [r.code for r in predicted],
            }
        reasons = ()
        if not ok and answer.get("code") == "cudnn.te_refused":  # TE's C++ refusal, for the
            # device as the worker planned it (a binding rule stated in CPP_RULES)
            text = (answer.get("summary") or answer.get("message") or "").strip()
            reasons = (reject("cudnn.te_refused", f"TE's C++ refuses it before asking cuDNN: "
                              f"{text[:2000]}", observed="derive", limit="a config TE's C++ "
                              "asks cuDNN about", stage="rule"),)  # fmt: skip
        elif not ok:
            graph, step = answer.get("graph") or "fwd", answer.get("step") or "?"
            text = (answer.get("message") or answer.get("summary") or "").strip()
            where = f"{cp_step}.{graph}.{step}" if cp_step else f"{graph}.{step}"
            reasons = (reject("cudnn.not_supported",
                              f"cuDNN {answer.get('cudnn_version')} refused the {graph} graph at "
                              f"{step}: {text[:2000]}", observed=where,
                              limit="a plan cuDNN supports", stage="graph_build"),)  # fmt: skip
        mode = answer.get("mode") or "deviceless"
        return ProbeResult(
            backend=self.name, supported=ok, reasons=reasons,
            stage=reasons[0].stage if reasons else "graph_build",
            evidence=f"cudnn {answer.get('cudnn_version')} graph ({mode})",
            elapsed_ms=(time.perf_counter() - t0) * 1e3, detail=detail if ok else
            {k: v for k, v in detail.items()
             if k in ("rule_drift", "cudnn", "mode", "descriptor", "graph_notes", "cp_steps")},
        )  # fmt: skip

    def _ask_cudnn(self, config: FusedAttnConfig, device: DeviceProfile, spec: bool = False
                   ) -> tuple[dict[str, Any] | None, Reason | None]:  # fmt: skip
        """cuDNN's answer for this config on this device, or why it cannot be asked."""
        installed = installed_cudnn()
        if importlib.util.find_spec("cudnn") is None or installed is None:
            return None, reject("cudnn.unavailable", "cudnn-frontend / libcudnn not installed: "
                                "the support-table prediction stands", stage="graph_build",
                                hint="pip install 'te-fl-attention[cudnn]'")  # fmt: skip
        want = cudnn_version(device)
        if want is not None and want != installed:
            return None, reject("cudnn.version_mismatch", f"the installed cuDNN "
                                f"{fmt_version(installed)} cannot answer for cuDNN "
                                f"{fmt_version(want)}: the support-table prediction stands",
                                stage="graph_build")  # fmt: skip
        try:
            return self._ask_worker(config, device, spec)
        except Exception as exc:  # noqa: BLE001 - a GPU/descriptor problem never escapes a probe
            return None, reject("cudnn.probe_error", f"asking cuDNN failed: "
                                f"{type(exc).__name__}: {exc}", stage="graph_build")  # fmt: skip

    def graph_spec(self, config: FusedAttnConfig, device: DeviceProfile) -> dict[str, Any]:
        """The graphs cuDNN is asked about for ``config`` on ``device`` (``explain
        --show-graph``): ``{"graphs": {"fwd": <cudnn-frontend JSON>, "bwd": ...}, "supported",
        "mode", "cudnn_version", "derived" (TE's derived config), "message"}``. Nothing is built
        where TE's Python filters or C++ refuse first, or where cuDNN cannot be asked here; the
        message says why."""
        binding = evaluate(BINDING_RULES, config, device)
        if binding:
            return {"graphs": {}, "message": "no graph is built: " + "; ".join(
                f"{r.code}: {r.message}" for r in binding)}  # fmt: skip
        answer, note = self._ask_cudnn(config, device, spec=True)
        if answer is None or note is not None and not answer.get("graph_spec"):
            return {"graphs": {}, "message": note.message if note else "cuDNN was not asked"}
        out = {k: answer.get(k) for k in ("supported", "mode", "cudnn_version", "derived")}
        out["graphs"] = answer.get("graph_spec") or {}
        if not answer.get("supported"):
            out["message"] = (answer.get("summary") or answer.get("message") or "")[:2000]
        return out

    def _ask_worker(self, config: FusedAttnConfig, device: DeviceProfile, spec: bool = False
                    ) -> tuple[dict[str, Any] | None, Reason | None]:  # fmt: skip
        """The worker's answer. A catalog GPU: its descriptor, deviceless, in the deviceless
        worker. The local GPU: the descriptor captured from the current device, with
        ``use_real_gpu``, in that device's worker (a real handle where the worker finds a real
        driver; the descriptor, deviceless, where it finds the stub). Never ran on a GPU."""
        from ...descriptors import DescriptorError, current_ordinal, descriptor_for
        from .worker import get_worker

        ordinal, real = None, False
        if device.source == "local" and device.has_gpu:  # gpu-only
            ordinal = current_ordinal()
        try:
            desc = descriptor_for(device, ordinal)
        except DescriptorError as exc:
            return None, reject("cudnn.bad_descriptor", f"no device descriptor for {device.name}: "
                                f"{exc}", stage="graph_build")  # fmt: skip
        # A real handle only for the device the descriptor was captured from.
        if ordinal is not None:  # gpu-only
            real = bool(desc.get("_captured"))
        answer = get_worker(ordinal).probe(config.to_dict(), desc, device.sm,
                                           timeout_s=self.timeout_s, use_real_gpu=real,
                                           spec=spec)  # fmt: skip
        answer["descriptor"] = (desc.get("_sources") or {}).get("*") or desc.get("_catalog")
        if not answer.get("decided"):
            return answer, reject(answer.get("code") or "cudnn.undecided",
                                  answer.get("message") or "cuDNN could not be asked",
                                  stage="graph_build")  # fmt: skip
        return answer, None


def installed_cudnn() -> tuple[int, int, int] | None:
    """The cuDNN version the probe worker would load (package metadata, no import)."""
    from ...device import installed_versions

    v = version(installed_versions()["cudnn"])
    if v is None:
        return None
    rel = (*v.release, 0, 0)
    return (rel[0], rel[1], rel[2])
