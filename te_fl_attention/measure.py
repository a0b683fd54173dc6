"""Measured mode: time each candidate that can run here on the config's shape; fastest wins.

What is timed: the kernel launch only. Each runner is split into host preparation (checks,
layout changes, FA2's head-dim padding, varlen packing, ``.cpu()`` reads, the dense bias SDPA
needs for bottom-right causal masks; :func:`te_fl_attention.kernels.run.prepare`) and the launch
(:meth:`~te_fl_attention.kernels.run.Launch.launch`); the preparation is done once, outside the
timed region. Then warm-up launches and the median of N timed launches (CUDA events recorded
around each launch, one synchronize at the end, on a GPU; ``perf_counter`` on CPU) of the
forward and, for training configs, of forward + backward (the backward of the kernel's own
output with respect to its prepared inputs).

On a GPU the config's real shape is timed. On CPU the shape is scaled down to at most
:data:`CPU_MAX_SCORE_ELEMENTS` score elements (batch * heads * s_q * s_kv: batch first, then
heads keeping the GQA kind, then both sequence lengths keeping their ratio; windows shrink with
s_kv), and the Decision says so. The Triton interpreter is never asked to run more than
:data:`INTERPRETER_MAX_SCORE_ELEMENTS`.

"Not measured" is not "unsupported": a candidate the runner cannot express on this shape
(:class:`~te_fl_attention.kernels.run.Unsupported`, e.g. torch SDPA's cuDNN backend refusing a
dropout that is not a multiple of 1/16), or one too slow to time in the interpreter, keeps its
verdict and gets ``detail["not_measured"]`` (a reason, stage ``measure``) and a
``timing_note``. Timed candidates trade places among their own rule-priority slots; a candidate
that is not timed keeps its slot (see :meth:`Policy.order`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import backends, problems
from .decide import metric
from .kernels import run as runner
from .reasons import ProbeResult, Reason

if TYPE_CHECKING:
    from .config import FusedAttnConfig
    from .device import DeviceProfile

CPU_MAX_SCORE_ELEMENTS = 2**22
INTERPRETER_MAX_SCORE_ELEMENTS = 2**14
#: (warm-up runs, timed runs) per device kind.
REPEATS = {"cuda": (3, 10), "cpu": (1, 5)}


def timing_shape(config: FusedAttnConfig, cuda: bool | None = None
                 ) -> tuple[problems.Shape, str | None]:  # fmt: skip
    """The shape timed here and, when it is not the real one, a sentence saying so."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    real = problems.real_shape(config)
    if cuda or real.score_elements() <= CPU_MAX_SCORE_ELEMENTS:
        return real, None
    b, hkv, group = real.batch, real.num_gqa_groups, real.num_heads // real.num_gqa_groups
    sq, skv, cap = real.seqlen_q, real.seqlen_kv, CPU_MAX_SCORE_ELEMENTS

    def n() -> int:
        return b * hkv * group * sq * skv

    b = max(1, min(b, cap // max(1, n() // b)))
    while n() > cap and hkv > 1:
        hkv //= 2
    while n() > cap and group > min(2, real.num_heads // real.num_gqa_groups):
        group //= 2
    if n() > cap:
        f = math.sqrt(cap / n())
        sq, skv = max(1, int(sq * f)), max(1, int(skv * f))
    shape = problems.resize(real, batch=b, seqlen_q=sq, seqlen_kv=skv, kv_heads=hkv, group=group)
    note = (f"on CPU we time a shape scaled down to at most 2^{int(math.log2(cap))} score "
            f"elements (batch*heads*s_q*s_kv): {shape.text()} instead of {real.text()}")
    return shape, note


def _median_ms(fn: Callable[[], Any], warmup: int, repeats: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` (a launch, nothing else) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if cuda:  # gpu-only
        torch.cuda.synchronize()  # the warm-up's work is not in the first timing
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]  # fmt: skip
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_backend(backend: str, problem: problems.Problem, *, training: bool,
                 warmup: int = 1, repeats: int = 5) -> dict[str, float]:  # fmt: skip
    """Median milliseconds of ``fwd`` and (``training``) ``fwd_bwd`` on ``problem``: the
    runner's preparation is done once per metric, outside the timed region; only the launch
    (and the backward through it) is timed."""
    cuda = torch.cuda.is_available()
    feats = {n: x for n, x in problem.features.items() if n != "generator"}
    q, k, v = problem.inputs()
    with torch.no_grad():
        fwd = runner.prepare(backend, q, k, v, **feats)
        out = {"fwd": _median_ms(fwd.launch, warmup, repeats, cuda)}
    if training:
        qg, kg, vg = problem.inputs(grad=True)
        prepared = runner.prepare(backend, qg, kg, vg, **feats).leaves()
        inputs = prepared.inputs()
        grad = torch.ones_like(prepared.primary(prepared.launch()))

        def fwd_bwd() -> None:
            o = prepared.primary(prepared.launch())
            torch.autograd.grad(o, inputs, grad)

        out["fwd_bwd"] = _median_ms(fwd_bwd, warmup, repeats, cuda)
    return out


def skipped(backend: str, why: str) -> ProbeResult:
    """The note a candidate gets when it is not timed here (its verdict stands)."""
    return ProbeResult(backend, True, stage="", detail={"timing_note": why})


def not_measured(backend: str, code: str, why: str, **detail: Any) -> ProbeResult:
    """A candidate that cannot be timed here keeps its verdict and its rule-priority place:
    ``detail["not_measured"]`` is the reason (stage ``measure``), ``timing_note`` says it."""
    name = backends.display(backend)
    reason = Reason(code, f"{name} is not measured: {why}", "measure",
                    limit="a problem the runner can time here")  # fmt: skip
    text = f"not measured: {why}; it keeps its rule-priority place"
    return ProbeResult(backend, True, stage="", detail={"timing_note": text,
                                                        "not_measured": reason.to_dict(),
                                                        **detail})  # fmt: skip


def check(backend: str, config: FusedAttnConfig, device: DeviceProfile
          ) -> tuple[ProbeResult, bool]:  # fmt: skip
    """Time ``backend`` (which can run here) on ``config``'s timing shape.

    Returns the stage's own result and whether to store it: timings (stage ``measure``,
    ``detail["timings_ms"]``) or a failure on that shape (refused, stage ``measure``) are stored;
    a shape the runner cannot express or the interpreter cannot take is "not measured" (a note
    with its reason, not stored).
    """
    cuda = torch.cuda.is_available()
    shape, _ = timing_shape(config, cuda)
    if backend == "triton" and not cuda and shape.score_elements() > INTERPRETER_MAX_SCORE_ELEMENTS:
        return not_measured(backend, "measure.too_slow", f"{shape.score_elements()} score "
                            "elements are too many for the Triton interpreter (at most "
                            f"{INTERPRETER_MAX_SCORE_ELEMENTS})", too_slow=True), False
    warmup, repeats = REPEATS["cuda" if cuda else "cpu"]
    t0 = time.perf_counter()
    try:
        problem = problems.build(config, shape, device=runner.tensor_device())
        timings = time_backend(backend, problem, training=config.is_training, warmup=warmup,
                               repeats=repeats)  # fmt: skip
    except runner.Unsupported as exc:
        return not_measured(backend, "measure.not_expressible", str(exc)), False
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory on the real shape
        if cuda:  # gpu-only
            torch.cuda.empty_cache()
        text = problems.describe_error(exc, 1000)
        name = backends.display(backend)
        why = Reason("measure.failed", f"{name} failed on the timed shape {shape.text()}: {text}",
                     "measure", observed=problems.error_type(exc),
                     limit="runs on the config's shape")  # fmt: skip
        return ProbeResult(backend, False, (why,), "measure", "timing run",
                           (time.perf_counter() - t0) * 1e3), True  # fmt: skip
    detail = {"timings_ms": timings, "timed_shape": shape.to_dict(), "repeats": repeats}
    return ProbeResult(backend, True, (), "measure", f"timed on {shape.text()}",
                       (time.perf_counter() - t0) * 1e3, detail), True  # fmt: skip


def describe(config: FusedAttnConfig, device: DeviceProfile) -> dict[str, Any]:
    """What the Decision says about measured mode: metric, timed shape, scaling note."""
    if device.source != "local":
        return {"metric": metric(config), "shape": None, "repeats": None,
                "note": f"{device.name} is a what-if profile: nothing is timed from this machine; "
                "the rule priority decides"}  # fmt: skip
    shape, note = timing_shape(config)
    return {"metric": metric(config), "shape": shape.to_dict(), "note": note,
            "repeats": REPEATS["cuda" if torch.cuda.is_available() else "cpu"][1]}  # fmt: skip
