"""TritonFlashAttention (ours): rules for the features our Triton kernel supports, then, on the
local device, one tiny compile-and-run of the config's kind.

Supported: fp16/bf16/fp32, head dims up to 256 (q/k and v may differ), GQA/MQA, no_mask,
padding, causal top-left and bottom-right, sliding windows, bshd/sbhd/thd (varlen, padded
offsets), deterministic backward (always). Not supported: bias, ALiBi, dropout, FP8, context
parallelism, KV cache, non-vanilla softmax, softcap, num_splits, max_logit, score_mod, arbitrary
masks. The constants below mirror the kernel's ``SUPPORTED`` (a test keeps them in sync; the
kernel is not imported for the rules, so what-if questions need neither torch nor triton).

Stages after the rules: a catalog device keeps the rule verdict (``detail["predicted"]``); the
local GPU compiles and runs a tiny problem (stages ``compile``/``run``; isolated in the tiny-run
worker process, :mod:`te_fl_attention.run_worker`); the local CPU runs it in
the Triton interpreter when the probe was built with ``interpret=True`` (the selector sets that
from ``TRITON_INTERPRET``; probes read no environment), else refuses at stage ``run``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

from ..config import FusedAttnConfig
from ..device import DeviceProfile
from ..reasons import ProbeResult, Reason
from .base import RuleProbe, no_gpu, reject
from .common import ALL_BACKENDS

MAX_HEAD_DIM = 256  # SUPPORTED["max_head_dim"]
DTYPES = ("fp16", "bf16", "fp32")  # SUPPORTED["dtypes"]
MIN_SM = 80  # SUPPORTED["min_sm"]
NO_GPU_MESSAGE = "no GPU; set TRITON_INTERPRET=1 to run the kernel on CPU (slow)"
_WHATIF_NO_GPU = no_gpu("TritonFlashAttention")


def requires_gpu(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """A what-if device without a GPU cannot run the kernel (the local machine is asked at the
    run stage instead, where the Triton interpreter may stand in for a GPU)."""
    return _WHATIF_NO_GPU(c, d) if d.source != "local" else None


#: Whether the kernel module exists, per ``find_spec`` function (it does not change in a process;
#: a test that swaps ``find_spec`` asks again).
_KERNEL_FOUND: dict[object, bool] = {}


def kernel_available(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Our kernel module must exist in this installation (it ships with the Triton issue)."""
    find = importlib.util.find_spec
    found = _KERNEL_FOUND.get(find)
    if found is None:
        found = _KERNEL_FOUND[find] = find("te_fl_attention.kernels.triton_flash") is not None
    if not found:
        return reject(
            "triton.kernel_missing",
            "the Triton flash kernel is not part of this te-fl-attention build yet",
            observed=None,
            limit="te_fl_attention.kernels.triton_flash",
            stage="import",
        )
    return None


def triton_installed(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Triton must be installed on the device (package metadata)."""
    if d.triton is None:
        return reject(
            "triton.not_installed",
            "triton is not installed",
            observed=None,
            limit="triton",
            stage="import" if d.source == "local" else "rule",
            hint="pip install triton",
        )
    return None


def sm(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Our kernel targets tensor-core GPUs with bf16: sm80 and newer."""
    if d.sm is not None and d.sm < MIN_SM:
        return reject(
            "triton.sm",
            f"our Triton kernel needs sm >= {MIN_SM} (found sm{d.sm})",
            observed=d.sm,
            limit=f">= {MIN_SM}",
        )
    return None


def dtype(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """fp16, bf16 and fp32 inputs (fp32 accumulation)."""
    if c.dtype not in DTYPES:
        return reject(
            "triton.dtype",
            f"qkv_dtype = {c.dtype} is not supported by our Triton kernel",
            observed=c.dtype,
            limit=", ".join(DTYPES),
        )
    return None


def head_dim(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Head dims up to 256 (non-powers of two are padded inside the kernel)."""
    if max(c.head_dim_qk, c.head_dim_v) > MAX_HEAD_DIM:
        return reject(
            "triton.head_dim",
            f"head dims ({c.head_dim_qk}, {c.head_dim_v}) exceed {MAX_HEAD_DIM}",
            observed=(c.head_dim_qk, c.head_dim_v),
            limit=f"<= {MAX_HEAD_DIM}",
        )
    return None


def _feature(code: str, what: str, test, limit: str):
    def rule(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        if test(c):
            return reject(
                f"triton.{code}",
                f"{what} is not supported by our Triton kernel",
                observed=what,
                limit=limit,
            )
        return None

    rule.__name__ = f"triton_{code}"
    rule.__doc__ = f"Refuse {what}: the kernel does not implement it."
    return rule


UNSUPPORTED = (
    _feature("bias", "attention bias / ALiBi", lambda c: c.bias_type != "no_bias", "no_bias"),
    _feature("dropout", "dropout", lambda c: c.dropout != 0.0, "dropout = 0"),
    _feature("fp8", "FP8 attention", lambda c: c.fp8, "no FP8"),
    _feature("cp", "context parallelism", lambda c: c.context_parallel, "no context parallelism"),
    _feature("kv_cache", "KV cache", lambda c: c.kv_cache, "no KV cache"),
    _feature("softmax", "non-vanilla softmax", lambda c: c.softmax_type != "vanilla", "vanilla"),
    _feature("softcap", "softcap", lambda c: c.softcap != 0.0, "softcap = 0"),
    _feature("num_splits", "num_splits != 1", lambda c: c.num_splits != 1, "num_splits = 1"),
    _feature("max_logit", "return_max_logit", lambda c: c.return_max_logit, "no max_logit"),
    _feature("score_mod", "score_mod", lambda c: c.has_score_mod, "no score_mod"),
    _feature(
        "arbitrary",
        "an arbitrary mask",
        lambda c: c.attn_mask_type == "arbitrary",
        "no_mask, padding, causal variants",
    ),
)


class TritonFlashProbe(RuleProbe):
    """The ``triton`` candidate (ours); ranks after flash-attn inside the flash tier.

    ``interpret``: the local CPU may run the tiny problem in the Triton interpreter. ``run``:
    ``False`` stops after the rules."""

    name = "triton"
    RULES = (requires_gpu, *ALL_BACKENDS, kernel_available, triton_installed, sm, dtype,
             head_dim, *UNSUPPORTED)  # fmt: skip

    def __init__(self, interpret: bool = False, run: bool = True):
        self.interpret = interpret
        self.run = run

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        t0 = time.perf_counter()
        result = super().probe(config, device)
        if not result.supported or not self.run:
            return result
        if device.source != "local":
            return dataclasses.replace(result, detail={"predicted": True})
        result = self._run_here(config, device, result)
        return dataclasses.replace(result, elapsed_ms=(time.perf_counter() - t0) * 1e3)

    def _run_here(self, config: FusedAttnConfig, device: DeviceProfile, result: ProbeResult
                  ) -> ProbeResult:  # fmt: skip
        """Compile and run one tiny problem of the config's kind here (GPU, or interpreter)."""
        from .. import problems
        from ..kernels import run as runner

        ok, why = runner.can_run_here("triton", config, device, interpret=self.interpret)
        if not ok:
            code = "device.no_gpu" if why == NO_GPU_MESSAGE else "triton.cannot_run"
            reason = reject(code, why, observed=device.name, limit="CUDA GPU or TRITON_INTERPRET=1",
                            stage="run")  # fmt: skip
            return dataclasses.replace(result, supported=False, reasons=(reason,), stage="run")
        import torch

        cpu = not torch.cuda.is_available()
        where = "the Triton interpreter (CPU)" if cpu else device.name
        note, exc = problems.tiny_run("triton", config)  # isolated in a worker on a GPU
        if exc is not None:
            stage = "compile" if _is_compile_error(exc) else "run"
            text = problems.describe_error(exc)
            reason = reject(f"triton.{stage}_failed", f"our Triton kernel failed to {stage} a tiny "
                            f"problem on {where}: {text}", observed=problems.error_type(exc),
                            limit=f"{stage}s without error", stage=stage)  # fmt: skip
            return dataclasses.replace(result, supported=False, reasons=(reason,), stage=stage)
        if note is not None:
            return dataclasses.replace(result, detail={"run_note": note})
        return dataclasses.replace(result, stage="run", evidence=f"ran a tiny problem on {where}",
                                   detail={"interpreter": cpu})


def _is_compile_error(exc: BaseException) -> bool:
    """Triton's compiler errors (``triton.compiler.errors.CompilationError`` and kin; for a
    failure reported by the tiny-run worker, the modules of the original's classes)."""
    modules = getattr(exc, "modules", None) or [c.__module__ for c in type(exc).__mro__]
    return any(m.startswith("triton.compiler") for m in modules)
