"""Flash attention in Triton (ours): forward + backward with online softmax, as autograd op.

Entry point :func:`flash_attention`; :data:`SUPPORTED` describes what it accepts.

Algorithm (FlashAttention-2 style, written for this project):

* Forward: one program per (query block, batch * head). Scores are kept in log2 units
  (``q.k * scale * log2(e)``) so the online softmax uses ``exp2``; the running max is made
  finite before subtraction so rows that see no key stay NaN-free (output 0, lse ``-inf``).
  Key blocks are visited in one pipelined loop over the causal/window bounds of the query block
  (blocks outside the window are never touched); only the blocks at the edges of the fully
  visible range get the per-element mask (three separately pipelined loops, as before, cost
  registers: they spilled).
* Backward: ``delta = rowsum(dO * O)`` (preprocess kernel), then dQ with one program per
  (query block, batch * head) and dK/dV with one program per (key block, batch * kv head) that
  loops over (query head of its GQA group, query block) in one loop. When that launches too
  few programs for the GPU (MQA, small batch), dK/dV are instead computed per query head as
  fp32 partials and summed over each group with ``torch.sum``. Every output element is written
  by exactly one program in a fixed order and no atomics are used: the backward is
  deterministic (bitwise reproducible) by default; ``deterministic=True`` is accepted for API
  compatibility and changes nothing.
* Masks: key ``j`` is visible to query ``i`` iff ``j < len_kv`` and
  ``i + off - left <= j <= i + off + right`` (``-1`` = unbounded, causal forces ``right = 0``),
  with ``off = len_kv - len_q`` (each sequence's actual lengths) for bottom-right alignment,
  else 0. Queries beyond ``len_q`` (padding) get output 0, lse ``-inf`` and zero gradients.
* Layouts: bshd ``[b, s, h, d]``, sbhd ``[s, b, h, d]`` and thd ``[t, h, d]`` are read through
  their strides (no copies); thd sequences start at ``cu_seqlens_*_padded[i]`` when given.
  lse is fp32 in natural-log units, ``[b, h, sq]`` (bshd/sbhd) or ``[h, total_q]`` (thd).
* Addressing: the offset of each block (its first row, sequence start, head, batch) is a 64-bit
  scalar; offsets inside a tile are 32-bit unless a sequence stride makes them reach 2^31
  (``IDX64``, chosen per launch), so sbhd tensors with ``S * B * H * D >= 2^31`` elements work.
* Grid: (row block, batch * head) are folded onto grid axis x (limit 2^31 - 1); axes y and z
  (limit 65,535) are unused, so thd with thousands of packed sequences x heads launches.

Tiles: on a GPU each kernel's (BLOCK_M, BLOCK_N, warps, stages) comes from :mod:`.tuning`: the
kept configs (:func:`configs`, pruned by ``benchmarks/bench_kernel_resources.py``: no forward
spills, <= 256 spill bytes in the backward at head dim <= 128 on sm80 and sm90) are timed once
per key (device, kernel, dtype, head dims, feature flags, sequence-length and batch x head
buckets) and the choice is remembered (the probe cache once
:func:`te_fl_attention.cache.tuning.install` ran). Under ``TRITON_INTERPRET=1`` (CPU) one small
fixed configuration is used, and q/k/v tiles are upcast to fp32 before ``tl.dot`` (the
interpreter multiplies raw bf16 bit patterns, triton issue 11584); the softmax probabilities are
still rounded to the input dtype before ``P @ V`` so the numerics match the GPU path. fp32
inputs use ``input_precision="ieee"`` (no TF32). The GPU branch never ran on a GPU: CPU tests
run it up to the launch (tests/kernels/launch_double.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from typing import Any, NoReturn

import torch

try:
    import triton
except ImportError:  # pragma: no cover - SUPPORTED and validation stay importable without triton
    triton = None

from . import flash_kernels, tuning
from .flash_kernels import bwd_delta_kernel as _bwd_delta_kernel  # noqa: F401
from .flash_kernels import bwd_dkdv_kernel as _bwd_dkdv_kernel  # noqa: F401
from .flash_kernels import bwd_dq_kernel as _bwd_dq_kernel  # noqa: F401
from .flash_kernels import fwd_kernel as _fwd_kernel  # noqa: F401
from .tuning import Config

__all__ = ["SUPPORTED", "configs", "flash_attention"]

QKV_FORMATS = ("bshd", "sbhd", "thd")
MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
)
MAX_HEAD_DIM = 256
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

SUPPORTED: dict[str, Any] = {
    "dtypes": ("fp16", "bf16", "fp32"),
    "accumulation": "fp32",
    "max_head_dim": MAX_HEAD_DIM,  # both head_dim_qk and head_dim_v
    "head_dim_qk_ne_v": True,
    "non_pow2_head_dim": True,
    "qkv_formats": QKV_FORMATS,
    "attn_mask_types": MASK_TYPES,
    "sliding_window": True,  # (left, right), -1 = unbounded
    "bottom_right_diagonal": True,  # windows aligned top-left or bottom-right
    "gqa": True,
    "mqa": True,
    "thd_padded_offsets": True,  # cu_seqlens_*_padded
    "bias_types": ("no_bias",),
    "softmax_types": ("vanilla",),
    "dropout": False,
    "fp8": False,
    "arbitrary_mask": False,
    "return_lse": True,
    "deterministic_backward": True,  # always: no atomics anywhere
    "min_sm": 80,
    "devices": ("cuda",),  # plus CPU tensors under TRITON_INTERPRET=1 (tests only)
}

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Fixed (BLOCK_M, BLOCK_N) for every kernel under the interpreter; tests may override it.
_INTERPRET_BLOCKS = (16, 16)
# GQA/MQA dK/dV strategy: None = automatic (split into per-q-head partials when the grouped
# kernel would launch too few programs for the GPU), True / False = force (tests).
_GQA_SPLIT: bool | None = None


def interpreting() -> bool:
    if triton is None:  # pragma: no cover
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return bool(triton.knobs.runtime.interpret)


def _gpu_tensor_type() -> str:
    """The device type of the tensors a GPU launch takes: ``cuda``, or where
    :func:`~te_fl_attention.kernels.run.tensor_device` puts tensors while a GPU is present (the
    test seam presents one on a CPU machine, tensors staying on the CPU)."""
    if not torch.cuda.is_available():
        return "cuda"
    from .run import tensor_device

    return tensor_device()


# --------------------------------------------------------------------------------------------
# Tiles and launchers
# --------------------------------------------------------------------------------------------

#: The tiles the tuner may pick, per kernel and head-dim class (the larger padded head dim:
#: <= 64, <= 128, <= 256); the last of each list is the smallest. Every kept config at head dim
#: <= 128 compiles for sm80 and sm90 within :data:`SPILL_TARGET` (checked by
#: ``benchmarks/bench_kernel_resources.py`` and ``tests/kernels/test_kernel_resources.py``);
#: configs that spilled more were dropped (:data:`DROPPED`). Head dim 256 keeps small fallback
#: tiles (bigger ones overflow shared memory). A config that does not fit the device (shared
#: memory) fails to launch and the tuner skips it.
_CONFIGS: dict[str, dict[int, tuple[Config, ...]]] = {
    "fwd": {
        64: (Config(128, 64, 4, 3), Config(128, 64, 8, 3), Config(64, 64, 4, 3),
             Config(64, 32, 4, 2), Config(32, 32, 4, 1)),
        128: (Config(128, 64, 8, 3), Config(64, 64, 4, 3), Config(64, 32, 4, 3),
              Config(32, 64, 4, 2), Config(32, 32, 4, 2)),
        256: (Config(64, 32, 4, 2), Config(32, 32, 4, 1)),
    },
    "dq": {
        64: (Config(128, 64, 8, 2), Config(128, 32, 4, 2), Config(64, 64, 4, 3),
             Config(64, 32, 4, 2), Config(32, 32, 4, 1)),
        128: (Config(64, 64, 4, 3), Config(64, 32, 4, 2), Config(32, 32, 4, 1)),
        256: (Config(64, 32, 4, 2), Config(32, 32, 4, 1)),
    },
    "dkdv": {
        64: (Config(32, 128, 8, 2), Config(32, 64, 4, 2), Config(32, 32, 4, 1)),
        128: (Config(64, 64, 4, 3), Config(32, 64, 4, 2), Config(32, 32, 4, 1)),
        256: (Config(32, 32, 4, 1),),
    },
}  # fmt: skip
#: Measured over :data:`SPILL_TARGET` (or at it) on sm80 or sm90 with triton 3.7.1 and left out
#: of :data:`_CONFIGS`; the resource benchmark compiles them too, to show why.
DROPPED: dict[str, dict[int, tuple[Config, ...]]] = {
    "fwd": {64: (Config(128, 128, 8, 3),),  # sm80: 24 B
            128: (Config(128, 64, 4, 3), Config(128, 128, 8, 3),  # sm80: 616-896 B
                  Config(64, 32, 4, 2), Config(32, 32, 4, 1))},  # 8 B (sm80 / sm90 causal)
    "dq": {128: (Config(128, 64, 8, 2),  # sm80 causal: 976 B
                 Config(128, 32, 4, 2))},  # sm80 causal: 256 B, 255 registers (no margin)
    "dkdv": {64: (Config(64, 128, 8, 2), Config(64, 64, 4, 3)),  # sm80: 32 regs, ~2,900 B
             128: (Config(64, 128, 8, 2), Config(32, 128, 8, 2))},  # sm80: 3,200-5,800 B
}  # fmt: skip
#: fp32 inputs (no tensor cores with input_precision="ieee": big tiles spill heavily and take
#: minutes to compile): the small tile only.
_FP32_CONFIGS = (Config(32, 32, 4, 1),)
#: Spill (stack) bytes a kept config may use at head dim <= 128, on sm80 and sm90.
SPILL_TARGET = {"fwd": 0, "dq": 256, "dkdv": 256}
#: Rows per program of the delta preprocess kernel (not tuned).
_DELTA_BLOCK = 64
#: CUDA's grid limit along x; every kernel folds (row block, batch x head) onto that axis.
MAX_PROGRAMS = 2**31 - 1
#: Largest BLOCK_M / BLOCK_N / head-dim block any launch uses (bounds in-block offsets).
_MAX_BLOCK = 256
#: The JIT kernels (from :mod:`.flash_kernels`) by the names they are bound to here: looked up
#: at launch, so tests can swap them for launch doubles on this module.
_KERNELS = {"fwd": "_fwd_kernel", "delta": "_bwd_delta_kernel", "dq": "_bwd_dq_kernel",
            "dkdv": "_bwd_dkdv_kernel"}  # fmt: skip


def head_dim_class(d_qk: int, d_v: int) -> int:
    """64, 128 or 256: the config list for head dims (d_qk, d_v)."""
    d = max(d_qk, d_v)
    return 64 if d <= 64 else 128 if d <= 128 else 256


def configs(kernel: str, dtype: torch.dtype | str, d_qk: int, d_v: int) -> tuple[Config, ...]:
    """The tiles the tuner may pick for ``kernel`` (``fwd``, ``dq``, ``dkdv``)."""
    name = _DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name == "fp32":
        return _FP32_CONFIGS
    return _CONFIGS[kernel][head_dim_class(d_qk, d_v)]


@functools.cache
def code_digest() -> str:
    """Digest of this kernel's source (this host side and :mod:`.flash_kernels`) and the Triton
    version: part of every tuning key, so a changed kernel or compiler never reuses an old
    choice."""
    h = hashlib.sha256()
    for path in (__file__, flash_kernels.__file__):
        with open(path, "rb") as fh:
            h.update(fh.read())
    h.update(str(getattr(triton, "__version__", None)).encode())
    return h.hexdigest()[:32]


def _kernel(name: str) -> Any:
    """The JIT kernel ``name`` (looked up at launch: tests swap in a launch double)."""
    return globals()[_KERNELS[name]]


def _grid(rows: int, batch_heads: int, block: int) -> tuple[int]:
    """(row blocks x batch*heads,) on grid axis x (axes y and z stop at 65,535)."""
    programs = triton.cdiv(rows, block) * batch_heads
    if programs > MAX_PROGRAMS:
        raise ValueError(f"{programs} programs ({rows} rows in blocks of {block} x {batch_heads} "
                         f"batch*heads) exceed CUDA's grid limit {MAX_PROGRAMS}")  # fmt: skip
    return (programs,)


def _launch_errors() -> tuple[type[BaseException], ...]:
    """What a config that does not fit the device raises at compile / launch."""
    from triton.runtime import errors

    return tuple(getattr(errors, n) for n in ("OutOfResources", "PTXASError") if hasattr(errors, n))


def _launch(name: str, p: _Plan, rows: int, batch_heads: int, args: tuple, consts: dict,
            split: bool = False) -> None:  # fmt: skip
    """Launch kernel ``name`` over ``cdiv(rows, block) * batch_heads`` programs: the
    interpreter's fixed tile, else the tuned one on the GPU."""
    if rows <= 0 or batch_heads <= 0:
        return
    kernel = _kernel(name)
    if interpreting():
        block_m, block_n = _INTERPRET_BLOCKS
        grid = _grid(rows, batch_heads, block_n if name == "dkdv" else block_m)
        kernel[grid](*args, **consts, BLOCK_M=block_m, BLOCK_N=block_n)
        return
    _launch_gpu(name, kernel, p, rows, batch_heads, args, consts, split)


def _launch_gpu(name: str, kernel: Any, p: _Plan, rows: int, batch_heads: int, args: tuple,
                consts: dict, split: bool) -> None:
    """The compiled launch on ``args[0]``'s GPU with the tile :mod:`.tuning` picks for this
    problem's key (timed on the first launch of a key unless the store knows it). Never ran on
    a GPU."""
    device = args[0].device
    with torch.cuda.device(device):  # gpu-only
        cands = configs(name, args[0].dtype, consts["D_QK"], consts["D_V"])

        def run(cfg: Config) -> None:
            grid = _grid(rows, batch_heads, cfg.block_n if name == "dkdv" else cfg.block_m)
            kernel[grid](*args, **consts, **cfg.launch_meta())

        key = _tune_key(name, p, device, args[0].dtype, consts, batch_heads, split)
        timing = not torch.cuda.is_current_stream_capturing()  # no timing inside a CUDA graph
        run(tuning.tuner().choose(key, cands, run, skip=_launch_errors(), can_time=timing))


def _tune_key(name: str, p: _Plan, device: torch.device, dtype: torch.dtype, consts: dict,
              batch_heads: int, split: bool) -> tuning.TuneKey:
    """The tuning key of a launch (see :class:`~.tuning.TuneKey`). Never ran on a GPU."""
    props = torch.cuda.get_device_properties(device)  # gpu-only
    span = 0
    if p.left >= 0 and p.right >= 0:
        span = tuning.bucket(p.left + p.right + 1, 1, tuning.ROWS_MAX)
    return tuning.TuneKey(
        kernel=name, device=str(props.name), sm=10 * props.major + props.minor,
        sm_count=int(props.multi_processor_count),
        memory_gib=round(props.total_memory / 2**30, 1), code=code_digest(),
        dtype=_DTYPES[dtype], d_qk=consts["D_QK"], d_v=consts["D_V"], causal=p.causal,
        window_left=p.left >= 0, window_right=p.right >= 0, window_span=span,
        bottom_right=p.bottom_right, lens=p.has_lens, varlen=p.varlen,
        group=tuning.bucket(p.heads // p.kv_heads, 1, 64), gqa_split=split,
        rows_q=tuning.bucket(p.rows_q), rows_kv=tuning.bucket(p.rows_kv),
        programs=tuning.bucket(batch_heads, tuning.PROGRAMS_MIN, tuning.PROGRAMS_MAX),
    )  # fmt: skip


def _launch_delta(p: _Plan, args: tuple, consts: dict) -> None:
    """The delta preprocess kernel (fixed tile)."""
    if p.rows_q <= 0 or p.batch * p.heads <= 0:
        return
    kernel = _kernel("delta")
    block = _INTERPRET_BLOCKS[0] if interpreting() else _DELTA_BLOCK
    grid = _grid(p.rows_q, p.batch * p.heads, block)
    if interpreting():
        kernel[grid](*args, **consts, BLOCK_M=block)
        return
    with torch.cuda.device(args[0].device):  # gpu-only
        kernel[grid](*args, **consts, BLOCK_M=block, num_warps=4)


def _idx64(p: _Plan, tensors: tuple[torch.Tensor, ...], lses: tuple[torch.Tensor, ...]) -> bool:
    """Can an in-block offset (``row * seq_stride + col * dim_stride`` within one tile) pass
    2^31? Only for sequence strides of about 2^23 elements and more; then the kernels index in
    64 bits throughout. Offsets of blocks, sequences, heads and batches are always 64-bit."""
    rows = max(_MAX_BLOCK, *_INTERPRET_BLOCKS) - 1
    worst = 0
    for x in tensors:
        _, s, _, d = p.strides(x)
        worst = max(worst, rows * abs(s) + (_MAX_BLOCK - 1) * abs(d))
    for x in lses:
        worst = max(worst, rows * abs(p.lse_strides(x)[2]))
    return worst >= 2**31


def _bad(name: str, value: Any, expected: str) -> NoReturn:
    if isinstance(value, torch.Tensor):
        value = f"<tensor shape={tuple(value.shape)} dtype={value.dtype} device={value.device}>"
    raise ValueError(f"{name}={value!r} is not allowed: expected {expected}")


class _Plan:
    """Validated call: layout strides, sequence metadata and mask parameters."""

    __slots__ = (
        "fmt", "batch", "heads", "kv_heads", "rows_q", "rows_kv", "cu_q", "cu_kv", "start_q",
        "start_kv", "has_lens", "varlen", "bottom_right", "left", "right", "causal", "scale",
    )  # fmt: skip

    def strides(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, seq, head, dim) strides of a q/k/v-like tensor."""
        if self.fmt == "bshd":
            return x.stride(0), x.stride(1), x.stride(2), x.stride(3)
        if self.fmt == "sbhd":
            return x.stride(1), x.stride(0), x.stride(2), x.stride(3)
        return 0, x.stride(0), x.stride(1), x.stride(2)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int, int]:
        if self.fmt == "thd":
            return 0, lse.stride(0), lse.stride(1)
        return lse.stride(0), lse.stride(1), lse.stride(2)

    def seq_args(self, dummy: torch.Tensor) -> tuple:
        cu_q = self.cu_q if self.cu_q is not None else dummy
        cu_kv = self.cu_kv if self.cu_kv is not None else dummy
        start_q = self.start_q if self.start_q is not None else cu_q
        start_kv = self.start_kv if self.start_kv is not None else cu_kv
        return cu_q, start_q, cu_kv, start_kv

    def consts(self, d_qk: int, d_v: int, dtype: torch.dtype, idx64: bool) -> dict:
        upcast = interpreting()
        return {
            "D_QK": d_qk,
            "D_V": d_v,
            "BLOCK_DQK": max(16, triton.next_power_of_2(d_qk)),
            "BLOCK_DV": max(16, triton.next_power_of_2(d_v)),
            "IS_CAUSAL": self.right == 0,
            "HAS_LENS": self.has_lens,
            "VARLEN": self.varlen,
            "BOTTOM_RIGHT": self.bottom_right,
            "HAS_LEFT": self.left >= 0,
            "HAS_RIGHT": self.right >= 0,
            "UPCAST": upcast,
            "IDX64": idx64,
            # fp32 operands: exact fp32 products (no TF32); 16-bit: the backend default.
            "DOT_PREC": "ieee" if (upcast or dtype == torch.float32) else None,
        }


def _check_cu(cu: Any, name: str, batch: int | None, device: torch.device) -> torch.Tensor:
    ok_types = (torch.int32, torch.int64)
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in ok_types:
        _bad(name, cu, "a 1-D int32/int64 tensor [b+1] of cumulative sequence lengths")
    if batch is not None and cu.numel() != batch + 1:
        _bad(name, cu, f"{batch + 1} entries (batch size + 1)")
    if cu.numel() < 1:
        _bad(name, cu, "at least one entry")
    if cu.device != device:
        _bad(name, cu, f"a tensor on {device} like q")
    return cu.contiguous()


def _plan(
    q: Any,
    k: Any,
    v: Any,
    qkv_format: Any,
    cu_seqlens_q: Any,
    cu_seqlens_kv: Any,
    cu_seqlens_q_padded: Any,
    cu_seqlens_kv_padded: Any,
    max_seqlen_q: Any,
    max_seqlen_kv: Any,
    attn_mask_type: Any,
    window_size: Any,
    bottom_right_diagonal: Any,
    softmax_scale: Any,
) -> _Plan:
    if triton is None:  # pragma: no cover
        raise ImportError("te_fl_attention.kernels.triton_flash needs triton (pip install triton)")
    if qkv_format not in QKV_FORMATS:
        _bad("qkv_format", qkv_format, f"one of {QKV_FORMATS}")
    ndim = 3 if qkv_format == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _bad(name, t, "a torch.Tensor")
        if t.dtype not in _DTYPES:
            _bad(f"{name}.dtype", t.dtype, "one of torch.float16, torch.bfloat16, torch.float32")
        if t.dtype != q.dtype:
            _bad(f"{name}.dtype", t.dtype, f"{q.dtype} like q")
        if t.device != q.device:
            _bad(f"{name}.device", t.device, f"{q.device} like q")
        if t.dim() != ndim:
            _bad(f"{name}.shape", tuple(t.shape), f"{ndim} dims for qkv_format={qkv_format!r}")
    if q.device.type != _gpu_tensor_type() and not interpreting():
        _bad("q.device", q.device, "a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d_qk:
        _bad("k.shape", tuple(k.shape), f"head_dim_qk {d_qk} like q")
    for name, d in (("head_dim_qk", d_qk), ("head_dim_v", d_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            _bad(name, d, f"1..{MAX_HEAD_DIM}")
    h, hkv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hkv or hkv < 1 or h % hkv != 0:
        _bad("k.shape", tuple(k.shape), f"kv heads equal in k and v and dividing q heads ({h})")
    if k.shape[:-1] != v.shape[:-1]:
        _bad("v.shape", tuple(v.shape), f"leading dims {tuple(k.shape[:-1])} like k")
    if attn_mask_type not in MASK_TYPES:
        _bad("attn_mask_type", attn_mask_type, f"one of {MASK_TYPES}")
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        _bad("window_size", window_size, "(left, right) ints >= -1 (-1 = unbounded)")
    top_left = attn_mask_type in ("causal", "padding_causal")
    if bottom_right_diagonal is None:
        bottom_right = not top_left
    elif not isinstance(bottom_right_diagonal, bool):
        _bad("bottom_right_diagonal", bottom_right_diagonal, "True, False or None")
    elif "causal" in attn_mask_type and bottom_right_diagonal == top_left:
        _bad(
            "bottom_right_diagonal",
            bottom_right_diagonal,
            f"{not top_left} or None for attn_mask_type={attn_mask_type!r}",
        )
    else:
        bottom_right = bottom_right_diagonal
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
    ):
        _bad("softmax_scale", softmax_scale, "a finite float or None")

    p = _Plan()
    p.fmt, p.heads, p.kv_heads = qkv_format, h, hkv
    p.left, p.right = int(window_size[0]), int(window_size[1])
    p.causal = "causal" in attn_mask_type
    if p.causal:
        p.right = 0
    p.bottom_right = bool(bottom_right)
    p.scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
    p.start_q = p.start_kv = None
    if qkv_format == "thd":
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is None:
                _bad(name, cu, "cumulative sequence lengths [b+1] for qkv_format='thd'")
        p.cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", None, q.device)
        p.batch = p.cu_q.numel() - 1
        p.cu_kv = _check_cu(cu_seqlens_kv, "cu_seqlens_kv", p.batch, q.device)
        if cu_seqlens_q_padded is not None:
            p.start_q = _check_cu(cu_seqlens_q_padded, "cu_seqlens_q_padded", p.batch, q.device)
        if cu_seqlens_kv_padded is not None:
            p.start_kv = _check_cu(cu_seqlens_kv_padded, "cu_seqlens_kv_padded", p.batch, q.device)
        p.has_lens = p.varlen = True
        rows = []
        for name, given, cu in (
            ("max_seqlen_q", max_seqlen_q, p.cu_q),
            ("max_seqlen_kv", max_seqlen_kv, p.cu_kv),
        ):
            if given is None:
                given = int((cu[1:] - cu[:-1]).max()) if p.batch > 0 else 0
            elif isinstance(given, bool) or not isinstance(given, int) or given < 0:
                _bad(name, given, "a non-negative int or None")
            rows.append(given)
        p.rows_q, p.rows_kv = rows
    else:
        for name, cu in (
            ("cu_seqlens_q_padded", cu_seqlens_q_padded),
            ("cu_seqlens_kv_padded", cu_seqlens_kv_padded),
        ):
            if cu is not None:
                _bad(name, cu, "None unless qkv_format='thd'")
        bdim = 0 if qkv_format == "bshd" else 1
        p.batch = q.shape[bdim]
        if k.shape[bdim] != p.batch:
            _bad("k.shape", tuple(k.shape), f"batch size {p.batch} like q")
        p.rows_q, p.rows_kv = q.shape[1 - bdim], k.shape[1 - bdim]
        p.varlen = False
        if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
            missing = "cu_seqlens_kv" if cu_seqlens_kv is None else "cu_seqlens_q"
            _bad(missing, None, "both cu_seqlens_q and cu_seqlens_kv, or neither")
        p.has_lens = cu_seqlens_q is not None
        if p.has_lens and "padding" not in attn_mask_type:
            _bad("attn_mask_type", attn_mask_type, "a padding* type when cu_seqlens are given")
        p.cu_q = p.cu_kv = None
        if p.has_lens:
            p.cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", p.batch, q.device)
            p.cu_kv = _check_cu(cu_seqlens_kv, "cu_seqlens_kv", p.batch, q.device)
    return p


def _forward(q, k, v, p: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    thd = p.fmt == "thd"
    out_shape = (*q.shape[:-1], v.shape[-1])
    if thd:  # tokens outside every sequence (padded offsets) stay 0 / -inf
        out = q.new_zeros(out_shape)
        lse = torch.full((p.heads, q.shape[0]), float("-inf"), device=q.device)
    else:
        out = q.new_empty(out_shape)
        lse = torch.empty((p.batch, p.heads, p.rows_q), device=q.device, dtype=torch.float32)
    args = (
        q, k, v, out, lse, *p.seq_args(lse),
        *p.strides(q), *p.strides(k), *p.strides(v), *p.strides(out), *p.lse_strides(lse),
        p.rows_q, p.rows_kv, p.heads, p.heads // p.kv_heads, max(p.left, 0), max(p.right, 0),
        p.scale * _LOG2E,
    )  # fmt: skip
    consts = p.consts(q.shape[-1], v.shape[-1], q.dtype, _idx64(p, (q, k, v, out), (lse,)))
    _launch("fwd", p, p.rows_q, p.batch * p.heads, args, consts)
    return out, lse


def _split_gqa(p: _Plan, device: torch.device) -> bool:
    """Compute dK/dV as per-q-head fp32 partials summed over each group (more programs, more
    memory) instead of one program per kv head looping over its group (few programs for
    MQA / small batches)? Both are deterministic."""
    group = p.heads // p.kv_heads
    if group == 1:
        return False
    if _GQA_SPLIT is not None:
        return _GQA_SPLIT
    if interpreting():  # no SMs to fill
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # gpu-only
    return p.batch * p.kv_heads * triton.cdiv(p.rows_kv, 64) < 2 * sms


def _backward(q, k, v, out, lse, do, p: _Plan) -> tuple[torch.Tensor, ...]:
    thd = p.fmt == "thd"
    new = torch.zeros_like if thd else torch.empty_like
    dq = new(q)
    group = p.heads // p.kv_heads
    split = _split_gqa(p, q.device)
    if split:  # fp32 partials [..., h, d] in k's layout, reduced over the group below
        alloc = torch.zeros if thd else torch.empty
        dk = alloc((*k.shape[:-2], p.heads, k.shape[-1]), device=k.device, dtype=torch.float32)
        dv = alloc((*v.shape[:-2], p.heads, v.shape[-1]), device=v.device, dtype=torch.float32)
    else:
        dk, dv = new(k), new(v)
    delta = torch.empty_like(lse)
    seq = p.seq_args(lse)
    idx64 = _idx64(p, (q, k, v, out, do, dq, dk, dv), (lse, delta))
    consts = p.consts(q.shape[-1], v.shape[-1], q.dtype, idx64)
    delta_args = (
        out, do, delta, seq[0], seq[1], *p.strides(out), *p.strides(do), *p.lse_strides(lse),
        p.rows_q, p.heads,
    )  # fmt: skip
    delta_consts = {"D_V": v.shape[-1], "BLOCK_DV": consts["BLOCK_DV"], "HAS_LENS": p.has_lens,
                    "VARLEN": p.varlen, "IDX64": idx64}  # fmt: skip
    _launch_delta(p, delta_args, delta_consts)
    common = (p.rows_q, p.rows_kv)
    mask = (max(p.left, 0), max(p.right, 0), p.scale * _LOG2E, p.scale)
    dq_args = (
        q, k, v, do, dq, lse, delta, *seq,
        *p.strides(q), *p.strides(k), *p.strides(v), *p.strides(do), *p.strides(dq),
        *p.lse_strides(lse), *common, p.heads, group, *mask,
    )  # fmt: skip
    _launch("dq", p, p.rows_q, p.batch * p.heads, dq_args, consts)
    heads = (p.heads, 1, group) if split else (p.kv_heads, group, 1)
    dkdv_args = (
        q, k, v, do, dk, dv, lse, delta, *seq,
        *p.strides(q), *p.strides(k), *p.strides(v), *p.strides(do), *p.strides(dk),
        *p.strides(dv), *p.lse_strides(lse), *common, *heads, *mask,
    )  # fmt: skip
    _launch("dkdv", p, p.rows_kv, p.batch * heads[0], dkdv_args, consts, split)
    if split:  # deterministic reduction over the q heads of each group
        dk = dk.unflatten(-2, (p.kv_heads, group)).sum(-2).to(k.dtype)
        dv = dv.unflatten(-2, (p.kv_heads, group)).sum(-2).to(v.dtype)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:  # pragma: no cover - only lse was used
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, ctx.plan)
        return dq, dk, dv, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    attn_mask_type: str = "no_mask",
    window_size: tuple[int, int] = (-1, -1),
    bottom_right_diagonal: bool | None = None,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused attention (Triton); differentiable in q, k and v. Returns ``out`` or ``(out, lse)``.

    Shapes: bshd ``[b, s, h, d]``, sbhd ``[s, b, h, d]``, thd ``[t, h, d]``; k/v may have fewer
    heads (GQA/MQA, ``h % h_kv == 0``) and v another head dim (each <= 256). thd needs
    ``cu_seqlens_q/kv`` ([b+1]); ``cu_seqlens_*_padded`` give each sequence's start offset;
    ``max_seqlen_*`` default to the longest sequence (one device sync each) and must not be
    smaller than it. With bshd/sbhd, ``cu_seqlens_q/kv`` give actual lengths (``padding*``
    masks); positions beyond are padding. Padding queries and fully masked rows get output 0,
    lse ``-inf`` and zero gradients. ``window_size=(left, right)``, ``-1`` = unbounded; causal
    masks force ``right = 0``. ``bottom_right_diagonal`` defaults to True except for
    ``causal``/``padding_causal``. lse is fp32 natural-log logsumexp, ``[b, h, sq]`` or
    ``[h, total_q]`` (thd), and is not differentiable. The backward never uses atomics and is
    always bitwise reproducible; ``deterministic`` is accepted for API compatibility.
    Raises ValueError naming the argument and the allowed values for unsupported inputs.
    """
    if not isinstance(deterministic, bool):
        _bad("deterministic", deterministic, "True or False")
    if not isinstance(return_lse, bool):
        _bad("return_lse", return_lse, "True or False")
    plan = _plan(
        q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
        cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
        bottom_right_diagonal, softmax_scale,
    )  # fmt: skip
    out, lse = _FlashAttention.apply(q, k, v, plan)
    return (out, lse) if return_lse else out
