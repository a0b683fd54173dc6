"""The problems candidates run on: a config's shape shrunk to a small random problem with its
features (:func:`build`), and the probes' tiny runs (:func:`tiny_run`: on a GPU in a worker
process, :mod:`te_fl_attention.run_worker`, that synchronizes after each run, so a kernel fault is
the failure of the candidate that ran and never poisons the caller; on CPU in-process).

Used by the probes (the tiny runs), the verify stage and measured mode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .kernels import reference
from .kernels import run as runner

if TYPE_CHECKING:
    from .config import FusedAttnConfig

SMALL = {"batch": 2, "seqlen": 32, "kv_heads": 2, "group": 2}
TINY = {"batch": 1, "seqlen": 16, "kv_heads": 1, "group": 2}
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """The sizes of one problem (window in the same units as the sequences)."""

    batch: int
    seqlen_q: int
    seqlen_kv: int
    num_heads: int
    num_gqa_groups: int
    head_dim_qk: int
    head_dim_v: int
    window_size: tuple[int, int] = (-1, -1)

    def score_elements(self) -> int:
        """batch * heads * s_q * s_kv: the size of the attention score matrix."""
        return self.batch * self.num_heads * self.seqlen_q * self.seqlen_kv

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "window_size": list(self.window_size)}

    def text(self) -> str:
        s = f"s={self.seqlen_q}" if self.seqlen_q == self.seqlen_kv else \
            f"s_q={self.seqlen_q}, s_kv={self.seqlen_kv}"  # fmt: skip
        heads = f"h={self.num_heads}" + (f"/{self.num_gqa_groups}"
                                         if self.num_gqa_groups != self.num_heads else "")
        return f"b={self.batch}, {heads}, {s}, d={self.head_dim_qk}" + (
            f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim_qk else "")


def real_shape(config: FusedAttnConfig) -> Shape:
    return Shape(config.batch_size, config.max_seqlen_q, config.max_seqlen_kv,  # type: ignore[arg-type]
                 config.num_heads, config.num_gqa_groups, config.head_dim_qk,  # type: ignore[arg-type]
                 config.head_dim_v, config.window_size)  # type: ignore[arg-type]  # fmt: skip


def resize(shape: Shape, *, batch: int, seqlen_q: int, seqlen_kv: int, kv_heads: int,
           group: int) -> Shape:  # fmt: skip
    """``shape`` with new sizes; the window shrinks with s_kv (a window that is active stays
    active: at least 1), the GQA ratio keeps its kind (MHA, GQA, MQA)."""
    left, right = shape.window_size

    def scale(w: int) -> int:
        return w if w <= 0 else max(1, round(w * seqlen_kv / shape.seqlen_kv))

    return dataclasses.replace(shape, batch=batch, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv,
                               num_heads=kv_heads * group, num_gqa_groups=kv_heads,
                               window_size=(scale(left), scale(right)))  # fmt: skip


def small_shape(config: FusedAttnConfig, sizes: dict[str, int] = SMALL) -> Shape:
    """The config's shape shrunk to ``sizes`` (batch, longest sequence, KV heads, group)."""
    real = real_shape(config)
    sq, skv, n = real.seqlen_q, real.seqlen_kv, sizes["seqlen"]
    longest = max(sq, skv)
    if longest > n:
        sq, skv = (max(1, round(s * n / longest)) for s in (sq, skv))
        if real.seqlen_q != real.seqlen_kv and sq == skv:  # keep cross-attention cross
            skv = sq + 1 if real.seqlen_kv > real.seqlen_q else max(1, sq - 1)
    group = real.num_heads // real.num_gqa_groups
    return resize(real, batch=min(real.batch, sizes["batch"]), seqlen_q=sq, seqlen_kv=skv,
                  kv_heads=min(real.num_gqa_groups, sizes["kv_heads"]),
                  group=min(group, sizes["group"]))  # fmt: skip


@dataclass
class Problem:
    """Random q/k/v in the config's layout and dtype, and the runner features describing them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    features: dict[str, Any]
    shape: Shape
    notes: list[str] = field(default_factory=list)

    def inputs(self, grad: bool = False, dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Fresh leaf copies of q/k/v (optionally in another dtype, optionally with grad)."""
        return tuple(x.detach().to(dtype or x.dtype).requires_grad_(grad)  # type: ignore[return-value]
                     for x in (self.q, self.k, self.v))  # fmt: skip


def _lengths(n: int, full: int, g: torch.Generator) -> torch.Tensor:
    low = max(1, (full + 1) // 2)
    return torch.randint(low, full + 1, (n,), generator=g)


def _cu(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)


def build(config: FusedAttnConfig, shape: Shape, *, device: str = "cpu", seed: int = 0) -> Problem:
    """A random problem of ``shape`` with ``config``'s features (raises
    :class:`~.kernels.run.Unsupported` for configs no runner can express: FP8, context
    parallelism, paged KV, softcap, score_mod...)."""
    why = runner.blocker(config)
    if why:
        raise runner.Unsupported(why)
    if config.dtype not in TORCH_DTYPES:
        raise runner.Unsupported(f"dtype {config.dtype} is not a runner dtype")
    dtype, g = TORCH_DTYPES[config.dtype], torch.Generator().manual_seed(seed)
    b, sq, skv = shape.batch, shape.seqlen_q, shape.seqlen_kv
    h, hkv, dqk, dv = shape.num_heads, shape.num_gqa_groups, shape.head_dim_qk, shape.head_dim_v
    fmt, mask = config.qkv_format, config.attn_mask_type
    feats: dict[str, Any] = {"qkv_format": fmt, "attn_mask_type": mask,
                             "window_size": shape.window_size,
                             "bottom_right_diagonal": config.bottom_right_diagonal,
                             "max_seqlen_q": sq, "max_seqlen_kv": skv,
                             "softmax_scale": config.softmax_scale,
                             "deterministic": config.deterministic}  # fmt: skip
    if "padding" in mask or fmt == "thd":
        lens_q = _lengths(b, sq, g)
        lens_kv = lens_q.clone() if sq == skv else _lengths(b, skv, g)
        feats["cu_seqlens_q"], feats["cu_seqlens_kv"] = _cu(lens_q), _cu(lens_kv)
    if fmt == "thd":
        rows = []
        for side, lens in (("q", lens_q), ("kv", lens_kv)):
            gaps = torch.randint(1, 4, (b,), generator=g) if config.pad_between_seqs else 0 * lens
            rows.append(int((lens + gaps).sum()))
            if config.pad_between_seqs:
                feats[f"cu_seqlens_{side}_padded"] = _cu(lens + gaps)
        shapes = [(rows[0], h, dqk), (rows[1], hkv, dqk), (rows[1], hkv, dv)]
    else:
        order = (lambda s, n, d: (b, s, n, d)) if fmt == "bshd" else (lambda s, n, d: (s, b, n, d))
        shapes = [order(sq, h, dqk), order(skv, hkv, dqk), order(skv, hkv, dv)]
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in shapes)
    notes = []
    if config.bias_shape is not None:
        code = config.bias_shape
        dims = (b if code[0] == "b" else 1, h if code[1] == "h" else 1,
                1 if code == "111s" else sq, skv)  # fmt: skip
        feats["bias_type"], feats["bias"] = config.bias_type, torch.randn(dims, generator=g)
        feats["bias"] = feats["bias"].to(dtype)
    elif config.bias_type == "alibi":
        feats["bias_type"] = "alibi"
        if config.alibi_slopes_shape is not None:
            slopes = reference.default_alibi_slopes(h)
            feats["alibi_slopes"] = slopes if len(config.alibi_slopes_shape) == 1 else \
                slopes.expand(b, h).contiguous()  # fmt: skip
    if config.softmax_type != "vanilla":
        feats["softmax_type"] = config.softmax_type
        if config.softmax_type == "learnable":
            feats["softmax_offset"] = torch.randn(h, generator=g)
    if config.dropout:
        feats["dropout_p"] = config.dropout
    if config.bias_requires_grad:
        notes.append("bias gradients are not compared")
    out = Problem(q, k, v, feats, shape, notes)
    if device != "cpu":
        out.q, out.k, out.v = (x.to(device) for x in (out.q, out.k, out.v))
        out.features = {n: x.to(device) if isinstance(x, torch.Tensor) else x
                        for n, x in feats.items()}  # fmt: skip
    return out


#: GPU tiny runs go to a worker process (:mod:`te_fl_attention.run_worker`); tests that fake a GPU
#: in this process turn it off to run in-process.
ISOLATE_GPU_RUNS = True
#: Seconds one isolated tiny run may take (a first Triton compile and autotune included).
TINY_RUN_TIMEOUT_S = 300.0


def error_type(exc: BaseException) -> str:
    """The name of the exception's type (for a failure reported by a worker: the original's)."""
    return getattr(exc, "type_name", None) or type(exc).__name__


def describe_error(exc: BaseException, limit: int = 2000) -> str:
    """``"Type: message"`` of an exception, capped at ``limit`` characters."""
    return f"{error_type(exc)}: {exc}"[:limit]


def synchronize() -> None:
    """Wait for the GPU's queued work, so that an asynchronous kernel fault (an illegal address)
    surfaces now, as the fault of the candidate that just ran. No-op without CUDA."""
    if torch.cuda.is_available():  # gpu-only
        torch.cuda.synchronize()


def tiny_run(backend: str, config: FusedAttnConfig, *, isolate: bool | None = None,
             worker: Any = None, timeout_s: float | None = None
             ) -> tuple[str | None, Exception | None]:  # fmt: skip
    """Run ``backend`` once (forward, + backward when training) on a :data:`TINY` problem of the
    config's kind on this machine: the probes' compile/import-and-run stage. Returns
    ``(note, error)``: a note when the runner cannot express the problem (nothing ran), the
    exception when it ran and failed, ``(None, None)`` on success.

    On a GPU (``isolate=None``: when CUDA is available and :data:`ISOLATE_GPU_RUNS`) the run goes
    to a worker process (``worker``, default :func:`.run_worker.get_worker`) on this process's
    current device, which synchronizes after it: a kernel fault, a crash of the worker or a run
    past ``timeout_s`` is this candidate's error, and never poisons the calling process (TE's
    training process when the plugin probes). On CPU (the reference, the Triton interpreter) it
    runs here."""
    busy = runner.busy()
    if busy:
        return f"tiny run skipped: {busy}", None
    if isolate is None:
        isolate = ISOLATE_GPU_RUNS and torch.cuda.is_available()
    if isolate:  # gpu-only
        from . import run_worker

        w = worker if worker is not None else run_worker.get_worker()
        return w.tiny_run(backend, config, TINY_RUN_TIMEOUT_S if timeout_s is None else timeout_s)
    return tiny_run_here(backend, config)


def tiny_run_here(backend: str, config: FusedAttnConfig) -> tuple[str | None, Exception | None]:
    """:func:`tiny_run` in this process (what the worker runs): build, run, backward, then
    synchronize on a GPU so an asynchronous fault is attributed to this run."""
    try:
        problem = build(config, small_shape(config, TINY), device=runner.tensor_device())
        q, k, v = problem.inputs(grad=config.is_training)
        out = runner.run(backend, q, k, v, **problem.features)
        if config.is_training:
            out.float().sum().backward()
        synchronize()
    except runner.Unsupported as exc:
        return f"tiny run skipped: {exc}", None
    except Exception as exc:  # noqa: BLE001 - the kernel's failure is the verdict
        return None, exc
    return None, None
