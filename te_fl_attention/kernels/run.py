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
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import reference

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

__all__ = ["run", "can_run_here", "RUNNERS", "Unsupported", "FEATURES", "use_interpreter",
           "interpreter_ready", "tensor_device"]  # fmt: skip

KERNEL = "te_fl_attention.kernels.triton_flash"

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
_ALIASES = {"reference": "unfused"}
_LAYOUT = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
           "cu_seqlens_kv_padded", "attn_mask_type", "window_size", "bottom_right_diagonal",
           "softmax_scale", "return_lse", *HINTS}  # fmt: skip

Features = dict[str, Any]


class Unsupported(ValueError):
    """A feature (or dtype, layout...) this runner cannot express for this backend."""


Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Features], Any]


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
def _unfused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Any:
    """The reference (the oracle itself): every feature."""
    return reference.attention(q, k, v, **{n: x for n, x in f.items() if n not in HINTS})


def _triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Any:
    """Our Triton kernel: masks, windows, GQA, thd; no bias, dropout or softmax variants."""
    tf = importlib.import_module(KERNEL)
    _require("triton", f, _LAYOUT, tuple(tf.SUPPORTED["attn_mask_types"]))
    return tf.flash_attention(q, k, v, **{n: f[n] for n in _LAYOUT})


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


def _flash(flavour: str) -> Runner:
    def runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Any:
        """flash-attn (never ran on a GPU here): bottom-right alignment only."""
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
        bottom_right = reference._bottom_right(mask, f["bottom_right_diagonal"])
        lq = gq[1] if gq else torch.tensor([q.shape[1]])
        lk = gk[1] if gk else torch.tensor([k.shape[1]])
        aligned = causal or left >= 0 or right >= 0 or f["bias_type"] == "alibi"
        if aligned and not bottom_right and bool((lq.cpu() != lk.cpu()).any()):
            raise Unsupported(f"{flavour} cannot run feature bottom_right_diagonal=False with "
                             "s_q != s_kv (flash-attn aligns masks bottom-right)")  # fmt: skip
        kw: dict[str, Any] = {"softmax_scale": f["softmax_scale"], "causal": causal,
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
        if dense:
            res = fn(q, k, v, **kw)
            out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
        else:
            out, lse = _varlen(fn, q, k, v, f, gq, gk, kw)
        if fmt == "sbhd":
            out = out.transpose(0, 1)
        if f["return_lse"]:
            if lse is None:
                raise RuntimeError(f"{flavour} returned no lse")
            return out, lse.float()
        return out

    runner.__name__ = f"_{flavour}"
    return runner


def _varlen(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            f: Features, gq: Any, gk: Any, kw: dict[str, Any]) -> tuple[Any, Any]:  # fmt: skip
    """Pack the sequences contiguously, call the varlen entry point, scatter back (zeros / -inf
    outside sequences, as the reference)."""
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
    res = fn(flat(q)[iq], flat(k)[ik], flat(v)[ik], cu_seqlens_q=_cu(gq[1]),
             cu_seqlens_k=_cu(gk[1]), max_seqlen_q=int(gq[1].max()),
             max_seqlen_k=int(gk[1].max()), **kw)  # fmt: skip
    out_p, lse_p = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
    rows, heads = flat(q).shape[0], q.shape[-2]
    out = out_p.new_zeros(rows, heads, out_p.shape[-1]).index_copy(0, iq, out_p)
    lse = None
    if lse_p is not None:
        lse = torch.full((heads, rows), float("-inf"), device=q.device).index_copy(
            1, iq, lse_p.float())
    if not thd:
        out = out.view(b, sq, heads, -1)
        lse = lse.view(heads, b, sq).transpose(0, 1).contiguous() if lse is not None else None
    return out, lse


def _first_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Any:
    """``flash``: the first flavour that imports, in TE's precedence FA4 > FA3 > FA2."""
    errors = []
    for flavour in ("fa4", "fa3", "fa2"):
        try:
            _flash_module(flavour)
        except RuntimeError as exc:
            errors.append(str(exc))
            continue
        return RUNNERS[flavour](q, k, v, f)
    raise RuntimeError("no flash-attn flavour can be imported: " + "; ".join(errors))


# ----------------------------------------------------------------------------------------- fused
def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: Features) -> Any:
    """torch SDPA restricted to its cuDNN backend (never ran on a GPU here): bshd/sbhd, no/causal
    masks, bias (pre/post-scale, ALiBi as a bias tensor), dropout; no windows, padding, lse."""
    allowed = {"qkv_format", "attn_mask_type", "bottom_right_diagonal", "bias_type", "bias",
               "alibi_slopes", "dropout_p", "softmax_scale", "max_seqlen_q", "max_seqlen_kv"}
    _require("fused", f, allowed, ("no_mask", "padding", "causal", "padding_causal",
                                   "causal_bottom_right", "padding_causal_bottom_right"))
    if f["qkv_format"] == "thd":
        raise Unsupported("fused cannot run feature qkv_format='thd' (SDPA takes dense tensors)")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    perm = (0, 2, 1, 3) if f["qkv_format"] == "bshd" else (1, 2, 0, 3)
    qh, kh, vh = (x.permute(*perm) for x in (q, k, v))
    sq, skv, h = qh.shape[2], kh.shape[2], qh.shape[1]
    mask = f["attn_mask_type"]
    scale = f["softmax_scale"] if f["softmax_scale"] is not None else q.shape[-1] ** -0.5
    off = skv - sq if reference._bottom_right(mask, f["bottom_right_diagonal"]) else 0
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
    if causal and not is_causal:
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(off)
        base = bias if bias is not None else q.new_zeros(1, 1, sq, skv)
        bias = base.masked_fill(~keep, float("-inf"))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = sdpa(qh, kh, vh, attn_mask=bias, dropout_p=f["dropout_p"], is_causal=is_causal,
                   scale=scale, enable_gqa=kh.shape[1] != h)  # fmt: skip
    inv = (0, 2, 1, 3) if f["qkv_format"] == "bshd" else (2, 0, 1, 3)
    return out.permute(*inv).contiguous()


RUNNERS: dict[str, Runner] = {
    "unfused": _unfused,
    "triton": _triton,
    "fa2": _flash("fa2"),
    "fa3": _flash("fa3"),
    "fa4": _flash("fa4"),
    "flash": _first_flash,
    "fused": _fused,
}


def _canonical(backend: str) -> str:
    name = _ALIASES.get(backend, backend)
    if name not in RUNNERS:
        allowed = ", ".join(sorted({*RUNNERS, *_ALIASES}))
        raise ValueError(f"backend={backend!r} is not known; allowed: {allowed}")
    return name


def run(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **features: Any) -> Any:
    """Run ``backend`` on q/k/v with ``features`` (the reference's keywords, see
    :data:`FEATURES`). Returns ``out`` or ``(out, lse)`` (``return_lse=True``).

    Raises :class:`Unsupported` (a ``ValueError``) naming a feature the backend cannot run,
    ``ValueError`` for an unknown backend or keyword, and ``RuntimeError`` when the backend's
    library cannot be imported.
    """
    name = _canonical(backend)
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown feature(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(FEATURES)}")  # fmt: skip
    return RUNNERS[name](q, k, v, {**FEATURES, **features})


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
    return bool(mod._interpreting()) and _interpreted(std.cdiv) and \
        _interpreted(getattr(mod, "_fwd_kernel", None))  # fmt: skip


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


def _blocker(config: FusedAttnConfig) -> str | None:
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
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
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
    why = _blocker(config) or busy()
    if why:
        return False, why
    if name == "unfused":
        return True, "the torch reference runs on any device"
    cuda = torch.cuda.is_available()
    if name == "triton":
        if importlib.util.find_spec(KERNEL) is None:
            return False, "the Triton kernel is not part of this build"
        if cuda:
            return True, "Triton on the local CUDA GPU"
        if interpret is None:
            interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if not interpret:
            return False, "no GPU; set TRITON_INTERPRET=1 to run the kernel on CPU (slow)"
        if not interpreter_ready():
            return False, ("TRITON_INTERPRET=1 was set after triton was imported (its "
                           "kernels are compiled, not interpreted): set it before Python starts")
        return True, "the Triton interpreter on CPU (TRITON_INTERPRET=1)"
    if not cuda:
        return False, f"{name} needs a CUDA GPU; this machine has none"
    flavours = ("fa4", "fa3", "fa2") if name == "flash" else (name,) if name in FLASH_MODULES \
        else ()  # fmt: skip
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

