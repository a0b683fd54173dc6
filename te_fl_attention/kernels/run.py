"""One calling convention for every candidate: ``run(backend, q, k, v, **features)``.

Features are the keyword names of :func:`te_fl_attention.kernels.reference.attention`, plus
``max_seqlen_q``/``max_seqlen_kv``/``deterministic`` (hints that change no result). The result is
``out``, or ``(out, lse)`` with ``return_lse=True``, in the reference's shapes and conventions.

=====================  ==========================================================================
backend                runs
=====================  ==========================================================================
``unfused``            :mod:`.reference` (any device, every feature); alias ``reference``
``triton``             our :mod:`.triton_flash` (CUDA; CPU only under ``TRITON_INTERPRET=1``)
``fa2``/``fa3``/``fa4``  the installed flash-attn 2 / 3 / 4 (CUDA only; never ran on a GPU here)
``flash``              the first importable of FA4, FA3, FA2 (never ran on a GPU here)
``fused``              torch SDPA's cuDNN backend, for what SDPA can express (CUDA only; never
                       ran on a GPU here). TE's own fused op is not called: it needs TE's
                       compiled extension and module state, so features SDPA cannot express
                       raise :class:`Unsupported` instead.
=====================  ==========================================================================

A feature a backend cannot run raises :class:`Unsupported` (a ``ValueError``) naming it; a library
that cannot be imported raises ``RuntimeError`` with the import error. :data:`RUNNERS` maps names
to implementations (tests swap entries in to inject kernels).

Every runner is split in two: :func:`prepare` does the host work (checks, layout transposes, FA2's
head-dim padding, varlen packing, ``.cpu()`` reads of the lengths, signature look-ups, the dense
bias SDPA needs for bottom-right causal masks) and returns a :class:`Launch`, whose
:meth:`~Launch.launch` is the kernel call alone (what measured mode times) and whose
:meth:`~Launch.finish` trims / unpacks the result. :func:`run` is ``prepare(...)()``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import backends
from . import reference

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

__all__ = ["run", "prepare", "Launch", "can_run_here", "RUNNERS", "Unsupported", "FEATURES",
           "use_interpreter", "interpreter_ready", "tensor_device", "pad_head_dims",
           "cudnn_sdpa_refusal"]  # fmt: skip

KERNEL = "te_fl_attention.kernels.triton_flash"
KERNEL_JIT = "te_fl_attention.kernels.flash_kernels"

#: Every feature keyword and its default ("not used").
FEATURES: dict[str, Any] = {
    "qkv_format": "bshd", "cu_seqlens_q": None, "cu_seqlens_kv": None,
    "cu_seqlens_q_padded": None, "cu_seqlens_kv_padded": None, "max_seqlen_q": None,
    "max_seqlen_kv": None, "attn_mask_type": "no_mask", "attention_mask": None,
    "window_size": (-1, -1), "bottom_right_diagonal": None, "bias_type": "no_bias", "bias": None,
    "alibi_slopes": None, "dropout_p": 0.0, "generator": None, "softmax_type": "vanilla",
    "softmax_offset": None, "softmax_scale": None, "deterministic": False, "return_lse": False,
}  # fmt: skip
#: Hints every backend accepts (the reference ignores them).
HINTS = ("max_seqlen_q", "max_seqlen_kv", "deterministic")
#: flash-attn flavour -> (distribution, module with flash_attn_func / flash_attn_varlen_func).
FLASH_MODULES = {
    "fa2": ("flash-attn", "flash_attn.flash_attn_interface"),
    "fa3": ("flash-attn-3", "flash_attn_interface"),
    "fa4": ("flash-attn-4", "flash_attn.cute.interface"),
}
_LAYOUT = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
           "cu_seqlens_kv_padded", "attn_mask_type", "window_size", "bottom_right_diagonal",
           "softmax_scale", "return_lse", *HINTS}  # fmt: skip

Features = dict[str, Any]


class Unsupported(ValueError):
    """A feature (or dtype, layout...) this runner cannot express for this backend."""


def _same(raw: Any) -> Any:
    return raw


@dataclass
class Launch:
    """One prepared run: host preparation is done, ``kernel(*args, **kwargs)`` is the launch.

    Measured mode times :meth:`launch` only (packing, padding, bias tensors, ``.cpu()`` syncs and
    signature look-ups happen in the preparation that built this object); :meth:`finish` turns
    the kernel's raw result into the reference's conventions (trim, unpack, transpose).
    ``grads`` are the positions in ``args`` of the kernel's q/k/v inputs (the tensors a
    forward + backward timing differentiates)."""

    kernel: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    finish: Callable[[Any], Any] = _same
    grads: tuple[int, ...] = (0, 1, 2)

    def launch(self) -> Any:
        """The kernel call itself (the raw result)."""
        return self.kernel(*self.args, **self.kwargs)

    def __call__(self) -> Any:
        return self.finish(self.launch())

    @staticmethod
    def primary(raw: Any) -> torch.Tensor:
        """The output tensor in a raw result (``(out, lse, ...)`` or ``out``)."""
        return raw[0] if isinstance(raw, (tuple, list)) else raw

    def leaves(self) -> Launch:
        """The same launch on detached copies of its q/k/v inputs that require grad (leaves:
        a timed backward then reaches the kernel's inputs and stops there)."""
        args = list(self.args)
        for i in self.grads:
            args[i] = args[i].detach().requires_grad_(True)
        return dataclasses.replace(self, args=tuple(args))

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.args[i] for i in self.grads)


#: A runner: prepares a :class:`Launch` from q/k/v and the features. A plain function
#: ``(q, k, v, features) -> out`` put into :data:`RUNNERS` (tests inject kernels so) is its own
#: launch, with no preparation.
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Features], Any]


def _preparer(fn: Callable[..., Launch]) -> Callable[..., Launch]:
    fn.prepares = True  # type: ignore[attr-defined]
    return fn


def _prepare_with(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features
                  ) -> Launch:  # fmt: skip
    fn = RUNNERS[name]
    if getattr(fn, "prepares", False):
        return fn(q, k, v, f)
    return Launch(fn, (q, k, v, f))


def _used(f: Features) -> dict[str, Any]:
    """The features set to something other than "not used"."""
    out = {}
    for name, default in FEATURES.items():
        value = f[name]
        if name == "window_size":
            left, right = value
            if left >= 0 or (right >= 0 and "causal" not in f["attn_mask_type"]):
                out[name] = value
        elif name == "generator":
            if value is not None and f["dropout_p"] > 0:
                out[name] = value
        elif isinstance(value, torch.Tensor) or value != default:
            out[name] = value
    return out


def _require(backend: str, f: Features, allowed: set[str], masks: tuple[str, ...] | None = None
             ) -> None:  # fmt: skip
    for name, value in _used(f).items():
        if name not in allowed:
            shown = "<tensor>" if isinstance(value, torch.Tensor) else repr(value)
            raise Unsupported(f"{backend} cannot run feature {name}={shown}")
    if masks is not None and f["attn_mask_type"] not in masks:
        raise Unsupported(f"{backend} cannot run feature attn_mask_type={f['attn_mask_type']!r}; "
                         f"allowed: {', '.join(masks)}")  # fmt: skip


# ------------------------------------------------------------------------------ reference, Triton
@_preparer
def run_unfused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Launch:
    """The reference (the oracle itself): every feature."""
    return Launch(reference.attention, (q, k, v), {n: x for n, x in f.items() if n not in HINTS})


@_preparer
def run_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Launch:
    """Our Triton kernel: masks, windows, GQA, thd; no bias, dropout or softmax variants."""
    tf = importlib.import_module(KERNEL)
    _require("triton", f, _LAYOUT, tuple(tf.SUPPORTED["attn_mask_types"]))
    return Launch(tf.flash_attention, (q, k, v), {n: f[n] for n in _LAYOUT})


# ------------------------------------------------------------------------------------ flash-attn
def _flash_module(flavour: str) -> Any:
    dist, module = FLASH_MODULES[flavour]
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as exc:
        raise RuntimeError(f"{flavour} ({dist}) cannot be imported ({module}): {exc}") from exc


def _tokens(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Row indices of every token of every sequence, packed in order."""
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    return starts[seq] + torch.arange(int(lens.sum()), device=lens.device) - first[seq]


def _cu(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).to(torch.int32)


def _geometry(x: torch.Tensor, f: Features, side: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(starts, lens) of each sequence in the flat token rows of ``x``, or None when dense."""
    cu, padded = f[f"cu_seqlens_{side}"], f[f"cu_seqlens_{side}_padded"]
    if f["qkv_format"] == "thd":
        lens = (cu[1:] - cu[:-1]).long()
        return (padded if padded is not None else cu)[:-1].long(), lens
    if cu is None:
        return None
    b, s = x.shape[0], x.shape[1]
    return torch.arange(b, device=x.device) * s, (cu[1:] - cu[:-1]).long()


def pad_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """q/k/v padded with zeros to one head dim, ``max(head_dim_qk, head_dim_v)``, as TE 2.20.2
    does before calling FlashAttention 2 (``_pad_qkv_head_dim`` in
    ``dot_product_attention.py``; flash_api.cpp requires v's head size to equal q's). Returns
    the padded tensors and the original head_dim_v (the output is trimmed back to it, as TE's
    ``_trim_output``). Zero columns change no score, so out and lse are those of the unpadded
    problem (the softmax scale must be the unpadded one)."""
    import torch.nn.functional as F

    dqk, dv = q.shape[-1], v.shape[-1]
    d = max(dqk, dv)
    if dqk < d:
        q, k = F.pad(q, (0, d - dqk)), F.pad(k, (0, d - dqk))
    if dv < d:
        v = F.pad(v, (0, d - dv))
    return q, k, v, dv


def _flash(flavour: str) -> Runner:
    @_preparer
    def prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Launch:  # gpu-only
        """flash-attn (never ran on a GPU here): bottom-right alignment only. FA2 gets q/k/v
        padded to one head dim (TE's MLA padding) and its output trimmed."""
        allowed = set(_LAYOUT) | ({"bias_type", "alibi_slopes", "dropout_p"} if flavour == "fa2"
                                  else set())  # fmt: skip
        _require(flavour, f, allowed, reference.MASK_TYPES[:-1])
        if f["bias_type"] not in ("no_bias", "alibi"):
            raise Unsupported(f"{flavour} cannot run feature bias_type={f['bias_type']!r}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported(f"{flavour} cannot run feature dtype={q.dtype} (fp16/bf16 only)")
        fmt = f["qkv_format"]
        if fmt == "sbhd":  # flash-attn reads bshd
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        gq, gk = _geometry(q, f, "q"), _geometry(k, f, "kv")
        mask = f["attn_mask_type"]
        causal = "causal" in mask
        left, right = f["window_size"]
        right = 0 if causal else right
        bottom_right = reference.is_bottom_right(mask, f["bottom_right_diagonal"])
        lq = gq[1] if gq else torch.tensor([q.shape[1]])
        lk = gk[1] if gk else torch.tensor([k.shape[1]])
        aligned = causal or left >= 0 or right >= 0 or f["bias_type"] == "alibi"
        if aligned and not bottom_right and bool((lq.cpu() != lk.cpu()).any()):
            raise Unsupported(f"{flavour} cannot run feature bottom_right_diagonal=False with "
                             "s_q != s_kv (flash-attn aligns masks bottom-right)")  # fmt: skip
        scale = f["softmax_scale"]
        dv = v.shape[-1]
        if flavour == "fa2" and q.shape[-1] != dv:
            scale = q.shape[-1] ** -0.5 if scale is None else scale  # of the unpadded q
            q, k, v, dv = pad_head_dims(q, k, v)
        kw: dict[str, Any] = {"softmax_scale": scale, "causal": causal,
                              "deterministic": f["deterministic"]}  # fmt: skip
        window = (left, right) if (left >= 0 or right >= 0) else (-1, -1)
        kw["window_size"] = tuple(None if w < 0 else w for w in window) if flavour == "fa4" \
            else window  # fmt: skip
        if flavour == "fa2":
            kw["dropout_p"] = f["dropout_p"]
            if f["bias_type"] == "alibi":
                slopes = f["alibi_slopes"]
                slopes = reference.default_alibi_slopes(q.shape[-2]) if slopes is None else slopes
                kw["alibi_slopes"] = slopes.to(q.device, torch.float32)
        dense = gq is None and gk is None
        mod = _flash_module(flavour)
        fn = mod.flash_attn_func if dense else mod.flash_attn_varlen_func
        params = inspect.signature(fn).parameters
        for flag in ("return_attn_probs", "return_lse") if f["return_lse"] else ():
            if flag in params:  # FA2 then also returns the probabilities: only when asked
                kw[flag] = True

        def finish(res: Any) -> Any:
            out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
            if unpack is not None:
                out, lse = unpack(out, lse)
            out = out[..., :dv]  # TE's _trim_output after the MLA padding
            if fmt == "sbhd":
                out = out.transpose(0, 1)
            if f["return_lse"]:
                if lse is None:
                    raise RuntimeError(f"{flavour} returned no lse")
                return out, lse.float()
            return out

        unpack = None
        if dense:
            args: tuple[Any, ...] = (q, k, v)
        else:
            args, extra, unpack = _pack(q, k, v, f, gq, gk)
            kw.update(extra)
        return Launch(fn, args, kw, finish)

    prep.__name__ = f"_{flavour}"
    return prep


def _pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features, gq: Any, gk: Any
          ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], Callable[..., Any]]:  # fmt: skip
    """Pack the sequences contiguously for the varlen entry point (the varlen arguments), and the
    function that scatters its result back (zeros / -inf outside sequences, as the
    reference)."""
    thd = f["qkv_format"] == "thd"
    flat = (lambda x: x) if thd else (lambda x: x.reshape(-1, *x.shape[2:]))
    b, sq = (None, None) if thd else q.shape[:2]
    if gq is None:
        gq = (torch.arange(q.shape[0], device=q.device) * q.shape[1],
              torch.full((q.shape[0],), q.shape[1], device=q.device))  # fmt: skip
    if gk is None:
        gk = (torch.arange(k.shape[0], device=k.device) * k.shape[1],
              torch.full((k.shape[0],), k.shape[1], device=k.device))  # fmt: skip
    iq, ik = _tokens(*gq), _tokens(*gk)
    args = (flat(q)[iq], flat(k)[ik], flat(v)[ik])
    extra = {"cu_seqlens_q": _cu(gq[1]), "cu_seqlens_k": _cu(gk[1]),
             "max_seqlen_q": int(gq[1].max()), "max_seqlen_k": int(gk[1].max())}  # fmt: skip
    rows, heads = flat(q).shape[0], q.shape[-2]

    def unpack(out_p: torch.Tensor, lse_p: torch.Tensor | None) -> tuple[Any, Any]:
        out = out_p.new_zeros(rows, heads, out_p.shape[-1]).index_copy(0, iq, out_p)
        lse = None
        if lse_p is not None:
            lse = torch.full((heads, rows), float("-inf"), device=q.device).index_copy(
                1, iq, lse_p.float())
        if not thd:
            out = out.view(b, sq, heads, -1)
            lse = lse.view(heads, b, sq).transpose(0, 1).contiguous() if lse is not None else None
        return out, lse

    return args, extra, unpack


@_preparer
def run_first_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Launch:
    """``flash``: the first flavour that imports, in TE's precedence FA4 > FA3 > FA2."""
    errors = []
    for flavour in backends.precedence("flash"):
        try:
            _flash_module(flavour)
        except RuntimeError as exc:
            errors.append(str(exc))
            continue
        return _prepare_with(flavour, q, k, v, f)
    raise RuntimeError("no flash-attn flavour can be imported: " + "; ".join(errors))


# ----------------------------------------------------------------------------------------- fused
#: What torch SDPA says when no enabled backend takes the inputs (CUDA; and on CPU).
NO_SDPA_KERNEL = ("No available kernel", "No viable backend")


def cudnn_sdpa_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                       grad: bool) -> str | None:  # fmt: skip
    """Why torch SDPA's cuDNN backend would refuse these ``(b, h, s, d)`` inputs, or None.

    Mirrors ``sdp::can_use_cudnn_attention`` in pytorch/pytorch
    ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (read at commit 001f694a, a recent
    main: the installed torch 2.13 wheel carries no C++ sources): ``check_dtypes_low_precision``
    (fp16/bf16 on sm >= 80), ``check_cudnn_dropout`` (``dropout * 16`` must be an integer: cuDNN's
    dropout resolution is 1/16), the cuDNN 9.11-9.13 dropout exclusion,
    ``check_cudnn_deterministic``, ``check_cudnn_hardware_support`` (sm80..sm121), and
    ``check_cudnn_tensor_shapes``: b, h <= 65535; s_kv != 1; s_q != 1 with dropout; head dims
    multiples of 8 and at most 128, 192 only for (192, 128) on sm90/sm10x with cuDNN >= 9.11, 256
    on sm90/sm10x with cuDNN > 9.22 (not sm107 up to 9.25; torch built with cudnn-frontend >=
    1.24 is assumed); ``check_cudnn_d256_bprop_head_dim``: where d256 is supported, backward
    only for d_qk, d_v <= 128, (192, 128) and (256, 256). What this misses SDPA still refuses
    ("No available kernel"), which the runner reports the same way. The device-dependent part
    never ran on a GPU."""
    b, h, sq, dqk = q.shape
    skv, dv = k.shape[2], v.shape[3]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype={q.dtype} (cuDNN SDPA takes fp16/bf16)"
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return f"dropout_p={dropout_p:g} (cuDNN's dropout resolution is 1/16)"
    if b > 65535 or h > 65535:
        return f"batch={b}, heads={h} (cuDNN SDPA takes at most 65535 of each)"
    if skv == 1:
        return "s_kv=1 (cuDNN SDPA does not take key/value sequence length 1)"
    if dropout_p and sq == 1:
        return "s_q=1 with dropout (cuDNN SDPA does not take it)"
    if dqk % 8 or dv % 8:
        return f"head dims ({dqk}, {dv}) (cuDNN SDPA needs multiples of 8)"
    if torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled():  # fmt: skip
        return "torch.use_deterministic_algorithms(True) (cuDNN SDPA is not deterministic)"
    if torch.cuda.is_available():  # gpu-only
        return _device_refusal(dqk, dv, dropout_p, grad)
    return None  # on CPU SDPA refuses by itself


def _device_refusal(dqk: int, dv: int, dropout_p: float, grad: bool) -> str | None:  # gpu-only
    """The device- and cuDNN-version-dependent part of :func:`cudnn_sdpa_refusal`."""
    major, minor = torch.cuda.get_device_capability()
    ver = torch.backends.cudnn.version() or 0
    if not (8, 0) <= (major, minor) <= (12, 1):
        return f"sm{major}{minor} (cuDNN SDPA runs on sm80..sm121)"
    if dropout_p > 0 and 91100 < ver < 91400:
        return f"dropout with cuDNN {ver} (torch disables it for cuDNN 9.11-9.13)"
    big = (major == 9 and minor == 0) or major == 10
    d256 = big and ver > 92200 and not (major == 10 and minor == 7 and ver <= 92500)
    limit = 256 if d256 else 192 if big and ver >= 91100 and (dqk, dv) == (192, 128) else 128
    if max(dqk, dv) > limit:
        return f"head dims ({dqk}, {dv}) (cuDNN SDPA takes at most {limit} on sm{major}{minor})"
    bwd_ok = (dqk <= 128 and dv <= 128) or (dqk, dv) in ((192, 128), (256, 256))
    if grad and d256 and not bwd_ok:
        return (f"backward with head dims ({dqk}, {dv}) (cuDNN SDPA's backward takes d <= 128, "
                "(192, 128) and (256, 256))")
    return None


def _sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:  # gpu-only
    """The launch: torch SDPA restricted to its cuDNN backend (never ran on a GPU here). SDPA's
    "no available kernel" refusal means the runner cannot express the problem."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, **kw)
    except RuntimeError as exc:
        if any(text in str(exc) for text in NO_SDPA_KERNEL):
            raise Unsupported(f"fused (torch SDPA's cuDNN backend) refused the inputs: {exc}"
                              ) from exc  # fmt: skip
        raise


@_preparer
def run_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Launch:  # gpu-only
    """torch SDPA restricted to its cuDNN backend (never ran on a GPU here): bshd/sbhd, no/causal
    masks, bias (pre/post-scale, ALiBi as a bias tensor), dropout; no windows, padding, lse.
    Inputs :func:`cudnn_sdpa_refusal` names raise :class:`Unsupported` before SDPA is called."""
    allowed = {"qkv_format", "attn_mask_type", "bottom_right_diagonal", "bias_type", "bias",
               "alibi_slopes", "dropout_p", "softmax_scale", "max_seqlen_q", "max_seqlen_kv"}
    _require("fused", f, allowed, ("no_mask", "padding", "causal", "padding_causal",
                                   "causal_bottom_right", "padding_causal_bottom_right"))
    if f["qkv_format"] == "thd":
        raise Unsupported("fused cannot run feature qkv_format='thd' (SDPA takes dense tensors)")
    if f["qkv_format"] == "sbhd":  # SDPA's cuDNN path wants b, s, h, d strides: relayout here
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    qh, kh, vh = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    why = cudnn_sdpa_refusal(qh, kh, vh, f["dropout_p"], grad)
    if why:
        raise Unsupported(f"fused (torch SDPA's cuDNN backend) cannot run {why}")
    sq, skv, h = qh.shape[2], kh.shape[2], qh.shape[1]
    mask = f["attn_mask_type"]
    scale = f["softmax_scale"] if f["softmax_scale"] is not None else q.shape[-1] ** -0.5
    off = skv - sq if reference.is_bottom_right(mask, f["bottom_right_diagonal"]) else 0
    bias = None
    if f["bias_type"] in ("pre_scale_bias", "post_scale_bias"):
        bias = f["bias"].to(q.dtype) * (scale if f["bias_type"] == "pre_scale_bias" else 1.0)
    elif f["bias_type"] == "alibi":
        slopes = f["alibi_slopes"]
        slopes = reference.default_alibi_slopes(h) if slopes is None else slopes
        i = torch.arange(sq, device=q.device).view(sq, 1)
        j = torch.arange(skv, device=q.device).view(1, skv)
        dist = (i + off - j).abs().float()
        bias = (-slopes.to(q.device).float().view(-1, h, 1, 1) * dist).to(q.dtype)
    causal = "causal" in mask
    is_causal = causal and bias is None and off == 0
    if causal and not is_causal:  # a dense bias, built here (outside any timed region)
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(off)
        base = bias if bias is not None else q.new_zeros(1, 1, sq, skv)
        bias = base.masked_fill(~keep, float("-inf"))
    kw = {"attn_mask": bias, "dropout_p": f["dropout_p"], "is_causal": is_causal,
          "scale": scale, "enable_gqa": kh.shape[1] != h}  # fmt: skip
    inv = (0, 2, 1, 3) if f["qkv_format"] == "bshd" else (2, 0, 1, 3)
    return Launch(_sdpa_cudnn, (qh, kh, vh), kw, lambda out: out.permute(*inv).contiguous())


#: Name -> runner: every flash-attn flavour, and each registered candidate's runner
#: (``Backend.runner``; a candidate registered later is added on first use). Tests may put
#: kernels in.
RUNNERS: dict[str, Runner] = {f: _flash(f) for f in FLASH_MODULES}
_SEEN = [-1]


def _registered() -> None:
    """Add the runners of candidates registered since the last look (kept: a test's kernel)."""
    if _SEEN[0] != backends.version():
        for b in backends.all_backends():
            if b.runner is not None and b.name not in RUNNERS:
                RUNNERS[b.name] = backends.resolve(b.runner)
        _SEEN[0] = backends.version()


_registered()


def _canonical(backend: str) -> str:
    _registered()
    name = backends.aliases().get(backend.lower(), backend) if isinstance(backend, str) \
        else backend  # fmt: skip
    if name not in RUNNERS:
        allowed = ", ".join(sorted({*RUNNERS, *(a for a, n in backends.aliases().items()
                                                if n in RUNNERS)}))  # fmt: skip
        raise ValueError(f"backend={backend!r} is not known; allowed: {allowed}")
    return name


def prepare(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **features: Any
            ) -> Launch:  # fmt: skip
    """Do ``backend``'s host preparation for q/k/v with ``features`` and return the
    :class:`Launch` (``prepare(...)()`` is :func:`run`). Raises as :func:`run` does."""
    name = _canonical(backend)
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown feature(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(FEATURES)}")  # fmt: skip
    return _prepare_with(name, q, k, v, {**FEATURES, **features})


def run(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **features: Any) -> Any:
    """Run ``backend`` on q/k/v with ``features`` (the reference's keywords, see
    :data:`FEATURES`). Returns ``out`` or ``(out, lse)`` (``return_lse=True``).

    Raises :class:`Unsupported` (a ``ValueError``) naming a feature the backend cannot run,
    ``ValueError`` for an unknown backend or keyword, and ``RuntimeError`` when the backend's
    library cannot be imported.
    """
    return prepare(backend, q, k, v, **features)()


# ---------------------------------------------------------------------------- where things run
def _interpreted(fn: Any) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def interpreter_ready() -> bool:
    """True when our Triton kernel runs in the Triton interpreter: the interpreter is on, and both
    triton's own library and our kernel module were decorated for it (that happens at import:
    ``TRITON_INTERPRET=1`` must be set before triton is imported)."""
    if importlib.util.find_spec(KERNEL) is None or importlib.util.find_spec("triton") is None:
        return False
    import triton.language.standard as std

    mod = importlib.import_module(KERNEL)
    jit = importlib.import_module(KERNEL_JIT)
    return bool(mod.interpreting()) and _interpreted(std.cdiv) and \
        _interpreted(getattr(jit, "fwd_kernel", None))  # fmt: skip


def use_interpreter() -> bool:
    """Switch this process to the Triton interpreter without exporting ``TRITON_INTERPRET`` (child
    processes and :func:`~te_fl_attention.selector.default_selector` do not see it). Works only
    before triton is imported; returns :func:`interpreter_ready`."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        importlib.import_module(KERNEL)
        triton.knobs.runtime.interpret = True  # an in-process override (it also sets the env)
    except ImportError:
        return False
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return interpreter_ready()


def blocker(config: FusedAttnConfig) -> str | None:
    """Why no runner can build this config's problem at all (None when one can)."""
    if config.fp8:
        return "FP8 attention is not a runner feature (inputs are fp16/bf16/fp32)"
    if config.context_parallel:
        return "context parallelism needs several processes"
    if config.paged:
        return "paged KV caches are not a runner feature"
    if config.q_format != config.kv_format:
        return f"q in {config.q_format} and k/v in {config.kv_format}: one qkv_format per run"
    if config.has_score_mod:
        return "score_mod is not a runner feature"
    if config.softcap:
        return "softcap is not a runner feature (the reference has none)"
    return None


def busy() -> str | None:
    """Why nothing may run now (a CUDA graph is being captured, torch.compile is tracing)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # gpu-only
        return "a CUDA graph is being captured"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    return None


def can_run_here(backend: str, config: FusedAttnConfig, device: DeviceProfile, *,
                 interpret: bool | None = None) -> tuple[bool, str]:  # fmt: skip
    """Whether ``backend`` can run ``config``'s problem on this machine as ``device``, and why.

    Only the local device runs anything. On CPU: the reference always; ``triton`` only with the
    interpreter (``interpret``; ``None`` reads ``TRITON_INTERPRET``) and the kernel importable;
    flash-attn and ``fused`` need CUDA.
    """
    name = _canonical(backend)
    if device.source != "local":
        return False, f"{device.name} is a what-if profile: nothing runs on it from this machine"
    why = blocker(config) or busy()
    if why:
        return False, why
    if name == "unfused":
        return True, "the torch reference runs on any device"
    cuda = torch.cuda.is_available()
    if name == "triton":
        if importlib.util.find_spec(KERNEL) is None:
            return False, "the Triton kernel is not part of this build"
        if cuda:  # gpu-only
            return True, "Triton on the local CUDA GPU"
        if interpret is None:
            interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if not interpret:
            return False, "no GPU; set TRITON_INTERPRET=1 to run the kernel on CPU (slow)"
        if not interpreter_ready():
            return False, ("TRITON_INTERPRET=1 was set after triton was imported (its "
                           "kernels are compiled, not interpreted): set it before Python starts")
        return True, "the Triton interpreter on CPU (TRITON_INTERPRET=1)"
    desc = backends.find(name)
    if desc is not None and desc.runs_on_cpu:
        return True, f"{desc.display} runs on any device"
    if not cuda:
        return False, f"{name} needs a CUDA GPU; this machine has none"
    return _can_run_on_gpu(name)  # gpu-only


def _can_run_on_gpu(name: str) -> tuple[bool, str]:  # gpu-only
    """:func:`can_run_here` for flash-attn and ``fused`` on a CUDA machine."""
    flavours = backends.precedence(name) or ((name,) if name in FLASH_MODULES else ())
    errors = []
    for flavour in flavours:
        try:
            _flash_module(flavour)
            return True, f"{flavour} imports"
        except RuntimeError as exc:
            errors.append(str(exc))
    if errors:
        return False, "; ".join(errors)
    return True, "torch SDPA with the cuDNN backend"


def tensor_device() -> str:
    """Where runs put their tensors: the current CUDA device, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"

