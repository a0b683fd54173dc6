"""Numerical verification: run a candidate on a small random problem with the config's features
and compare it with the reference (:func:`te_fl_attention.kernels.reference.attention`).

The problem keeps what changes a kernel's code path (dtype, head dims, layout, mask kind, sliding
window, GQA/MQA ratio, padding/thd lengths, bias shape, ALiBi, softmax type, scale) and shrinks the
rest: batch <= 2, sequences <= 32 (windows scaled with them), <= 2 KV heads with <= 2 query heads
each. The output and, for training configs, dq/dk/dv are compared with the reference evaluated in
fp64 on CPU on the same (rounded) inputs. The error of a tensor is
``max|got - want| / max(1, max|want|)`` and must not exceed :data:`TOLERANCE` for the input dtype.
Dropout is switched off for the comparison (no two backends share a dropout RNG).

The problem comes from :mod:`te_fl_attention.problems` (as the probes' tiny runs do).
Verification runs in-process and synchronizes after the candidate's forward and backward.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

import torch

from . import backends
from .kernels import reference
from .kernels import run as runner
from .problems import Problem, build, describe_error, error_type, small_shape, synchronize
from .reasons import ProbeResult, Reason

if TYPE_CHECKING:
    from .config import FusedAttnConfig
    from .device import DeviceProfile

#: The one statement of the tolerances: max|got - want| / max(1, max|want|), per input dtype.
TOLERANCE: dict[str, float] = {"fp32": 2e-4, "fp16": 1e-2, "bf16": 5e-2}
#: The small problem verification runs (the probes' "tiny" problem is smaller still).
def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max(1, max|want|); NaN or inf anywhere counts as infinite."""
    if want.numel() == 0:
        return 0.0
    diff = (got.detach().float() - want.detach().float()).abs().max().item()
    scale = max(1.0, want.detach().float().abs().max().item())
    err = diff / scale
    return err if math.isfinite(err) else float("inf")


def compare(backend: str, problem: Problem, *, training: bool) -> dict[str, float]:
    """Errors of ``backend`` against the reference in fp64 on CPU (immune to TF32 settings):
    ``out`` (+ ``dq``/``dk``/``dv`` when ``training``)."""
    feats = {**problem.features, "dropout_p": 0.0}
    feats.pop("generator", None)
    q, k, v = problem.inputs(grad=training)
    out = runner.run(backend, q, k, v, **feats)
    synchronize()  # a fault of this kernel is this candidate's, not the next one's
    qr, kr, vr = (x.detach().cpu().double().requires_grad_(training) for x in (q, k, v))
    cpu = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in feats.items()
           if n not in runner.HINTS}  # fmt: skip
    want = reference.attention(qr, kr, vr, **cpu)
    errors = {"out": error(out.cpu(), want)}
    if training:
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
        out.backward(grad.to(out.device, out.dtype))
        synchronize()
        want.backward(grad.double())
        for name, got, ref in (("dq", q, qr), ("dk", k, kr), ("dv", v, vr)):
            errors[name] = error(got.grad.cpu(), ref.grad) if got.grad is not None else \
                float("inf")  # fmt: skip
    return errors


# ------------------------------------------------------------------------- the verification stage
def skipped(backend: str, why: str) -> ProbeResult:
    """The note a candidate gets when it cannot be verified here (its verdict stands)."""
    return ProbeResult(backend, True, stage="", detail={"numerics": {"skipped": why}})


def check(backend: str, config: FusedAttnConfig, device: DeviceProfile
          ) -> tuple[ProbeResult, bool]:  # fmt: skip
    """Verify ``backend`` (which can run here) on the small problem of ``config``.

    Returns the stage's own result and whether it is worth storing: a pass (stage ``numerics``),
    a mismatch (refused, stage ``numerics``, observed = max error, limit = tolerance) or a crash
    (refused, stage ``run``; a kernel's own ``ValueError`` too) are stored; a problem the runner
    cannot express (:class:`~.kernels.run.Unsupported`) is a note only.
    """
    t0 = time.perf_counter()
    name = backends.display(backend)
    try:
        problem = build(config, small_shape(config), device=runner.tensor_device())
        errors = compare(backend, problem, training=config.is_training)
    except runner.Unsupported as exc:
        return skipped(backend, f"not verified: {exc}"), False
    except Exception as exc:  # noqa: BLE001 - a crashing kernel is a refusal, not our crash
        text = describe_error(exc, 1000)
        why = Reason("numerics.run_failed", f"{name} failed on the verification problem: {text}",
                     "run", observed=error_type(exc), limit="runs without error")  # fmt: skip
        return ProbeResult(backend, False, (why,), "run", "verification run",
                           (time.perf_counter() - t0) * 1e3), True  # fmt: skip
    tol = TOLERANCE[config.dtype]
    worst = max(errors, key=lambda n: errors[n])
    notes = list(problem.notes)
    if config.dropout:
        notes.append("compared with dropout off (backends do not share a dropout RNG)")
    detail = {"numerics": {"max_error": errors, "tolerance": tol, "shape": problem.shape.to_dict(),
                           "notes": notes}}  # fmt: skip
    ms = (time.perf_counter() - t0) * 1e3
    evidence = f"matched the reference on {problem.shape.text()}"
    if errors[worst] <= tol:
        return ProbeResult(backend, True, (), "numerics", evidence, ms, detail), True
    why = Reason("numerics.mismatch", f"{name} differs from the reference on "
                 f"{problem.shape.text()}: max error {errors[worst]:.3g} in {worst} > "
                 f"{tol:g} allowed for {config.dtype}", "numerics", observed=errors[worst],
                 limit=tol, hint="a kernel bug or an unsupported feature slipped through the "
                 "rules: report it, and force another backend meanwhile")  # fmt: skip
    return ProbeResult(backend, False, (why,), "numerics", "verification run", ms, detail), True


def merge(base: ProbeResult, own: ProbeResult) -> ProbeResult:
    """``base`` (the probe's result) with a later stage's own result folded in: its detail, its
    refusal reasons and its stage (a skipped stage keeps ``base``'s)."""
    return dataclasses.replace(
        base,
        supported=base.supported and own.supported,
        reasons=(*base.reasons, *own.reasons),
        stage=own.stage or base.stage,
        elapsed_ms=base.elapsed_ms + own.elapsed_ms,
        detail={**base.detail, **own.detail},
    )
