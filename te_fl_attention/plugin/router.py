"""The FlashAttention router: TE's ``FlashAttention`` module, running what the decision chose.

TE constructs it where it would construct its own ``FlashAttention`` (same constructor) and calls
it with the same keywords (``**kwargs`` takes those newer TE versions add, e.g. ``softcap``,
``load_balancing_strategy``). The output is TE's: ``[s, b, h*d]`` for sbhd queries,
``[b, s, h*d]`` for bshd, ``[t, h*d]`` for thd, contiguous.

What runs is read from ``flash_attention_backend``:

* a :class:`~.te_backend.BackendVersion` (from our ``get_attention_backend``): its backend, after
  checking that the decision allows it, runs: ``fa2``/``fa3``/``fa4`` through TE's own
  FlashAttention (built on first use), ``triton`` through our kernel
  (``kernels.run.run("triton", ...)``; on CPU under ``TRITON_INTERPRET=1``);
* a plain ``Version`` (TE's own selector chose it): TE's FlashAttention runs it unchanged;
* ``None`` / ``Version("0")`` (the module called directly): our selector decides for these
  inputs first, and a decision outside the flash tier is refused.

Anything the decision does not allow, or a feature our kernel does not implement, raises
``RuntimeError`` naming the backend and the decision. Under ``torch.compile`` the Triton path is
the custom op ``te_fl_attention::triton_attention`` (its backward recomputes the forward through
the kernel's autograd), so the router traces without graph breaks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from contextlib import nullcontext
from typing import Any

import torch
from packaging.version import Version

from .. import backends
from ..config import normalize_window
from .te_backend import BackendVersion, flash_tier, get_attention_backend

DPA_BACKENDS = "transformer_engine.pytorch.attention.dot_product_attention.backends"
def _name(backend: str | None) -> str:
    """A backend's display name; ours (a flash-tier candidate the router runs through its
    runner, not TE's FlashAttention) marked so."""
    desc = backends.find(backend) if backend else None
    ours = desc is not None and desc.te_slot == "flash" and not desc.flavours
    return backends.display(backend) + (" (ours)" if ours else "")


class FlashAttentionRouter(torch.nn.Module):
    """Drop-in for TE's ``FlashAttention`` that runs the flash-tier backend the decision chose."""

    #: TE's FlashAttention class used for flash-attn flavours (None: import it from TE).
    native_class: type | None = None

    def __init__(self, softmax_scale: float, attention_dropout: float = 0.0,
                 attention_dropout_ctx: Any = nullcontext, attention_type: str = "self",
                 layer_number: int | None = None, deterministic: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_dropout = attention_dropout
        self.attention_dropout_ctx = attention_dropout_ctx
        self.attention_type = attention_type
        self.layer_number = 1 if layer_number is None else layer_number
        self.deterministic = deterministic
        self._extra_init = kwargs
        self.native: torch.nn.Module | None = None

    # ------------------------------------------------------------------------------ forward
    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask: Any = None, qkv_layout: str = "sbh3d",
                cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
                max_seqlen_q: int | None = None, max_seqlen_kv: int | None = None,
                attn_mask_type: str = "causal", window_size: tuple[int, int] | None = None,
                alibi_slopes: torch.Tensor | None = None, cp_group: Any = None,
                cp_global_ranks: Any = None, cp_stream: Any = None, cp_comm_type: str = "p2p",
                fp8: bool = False, fp8_meta: Any = None, quantizers: Any = None,
                pad_between_seqs: bool | None = False, inference_params: Any = None,
                flash_attention_backend: Version | None = None, fp8_output: bool = False,
                num_splits: int | None = 1, cu_seqlens_q_padded: torch.Tensor | None = None,
                cu_seqlens_kv_padded: torch.Tensor | None = None, **kwargs: Any
                ) -> torch.Tensor:  # fmt: skip
        """TE's FlashAttention.forward (keywords as TE passes them)."""
        call = dict(attention_mask=attention_mask, qkv_layout=qkv_layout,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                    max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                    attn_mask_type=attn_mask_type, window_size=window_size,
                    alibi_slopes=alibi_slopes, cp_group=cp_group, cp_global_ranks=cp_global_ranks,
                    cp_stream=cp_stream, cp_comm_type=cp_comm_type, fp8=fp8, fp8_meta=fp8_meta,
                    quantizers=quantizers, pad_between_seqs=pad_between_seqs,
                    inference_params=inference_params,
                    flash_attention_backend=flash_attention_backend, fp8_output=fp8_output,
                    num_splits=num_splits, cu_seqlens_q_padded=cu_seqlens_q_padded,
                    cu_seqlens_kv_padded=cu_seqlens_kv_padded, **kwargs)  # fmt: skip
        q, k, v = query_layer, key_layer, value_layer
        fab = flash_attention_backend
        if not isinstance(fab, BackendVersion):
            if fab is not None and fab.release != (0,):
                return self._run_native(q, k, v, call)  # TE's own selector chose it
            fab = self._decide(q, k, v, call)
            call["flash_attention_backend"] = fab
        backend = fab.backend
        if backend not in fab.allowed:
            raise refusal(backend, fab, "the decision does not allow it")
        if (q.shape[-2], k.shape[-2]) != fab.heads:
            raise refusal(backend, fab, f"the inputs have (num_heads, num_gqa_groups) = "
                          f"{(q.shape[-2], k.shape[-2])}, the decision was made for {fab.heads}")
        if backend not in backends.flavours():  # ours (Triton, any registered since)
            return self._run_ours(backend, q, k, v, call, fab)
        return self._run_native(q, k, v, call)

    # ------------------------------------------------------------------------------ backends
    def _run_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    call: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        native = self.native
        if native is None:
            cls = self.native_class or importlib.import_module(DPA_BACKENDS).FlashAttention
            native = cls(self.softmax_scale, attention_dropout=self.attention_dropout,
                         attention_dropout_ctx=self.attention_dropout_ctx,
                         attention_type=self.attention_type, layer_number=self.layer_number,
                         deterministic=self.deterministic, **self._extra_init)  # fmt: skip
            native.train(self.training)
            self.native = native
        native.attention_type = self.attention_type
        return native(q, k, v, **call)

    def _run_ours(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  call: dict[str, Any], fab: BackendVersion) -> torch.Tensor:  # fmt: skip
        """One of our kernels (its ``Backend.runner`` through :func:`.kernels.run.run`) on TE's
        call: TE's keywords as the runner's features, the output in TE's layout."""
        unsupported = _unsupported(call, self.training and self.attention_dropout > 0)
        if unsupported:
            raise refusal(name, fab, f"{_name(name)} does not implement {unsupported}")
        q_fmt, kv_fmt = tensor_formats(call["qkv_layout"])
        if q_fmt != kv_fmt:
            if {q_fmt, kv_fmt} != {"sbhd", "bshd"}:
                raise refusal(name, fab, f"q in {q_fmt} with k/v in {kv_fmt}")
            q = q.transpose(0, 1)
        mask = call["attn_mask_type"]
        cu_q, cu_kv = call["cu_seqlens_q"], call["cu_seqlens_kv"]
        if kv_fmt != "thd" and "padding" not in mask:
            cu_q = cu_kv = None  # TE passes full-length cu_seqlens for dense bshd/sbhd too
        elif kv_fmt != "thd" and cu_q is None:
            cu_q, cu_kv = _cu_seqlens_from_mask(call["attention_mask"], q, k, kv_fmt, fab)
        padded = bool(call["pad_between_seqs"]) and kv_fmt == "thd"
        left, right = normalize_window(mask, _window(call["window_size"]))
        attention = triton_attention if name == "triton" else functools.partial(_attention, name)
        out = attention(
            q, k, v, cu_q, cu_kv, call["cu_seqlens_q_padded"] if padded else None,
            call["cu_seqlens_kv_padded"] if padded else None, kv_fmt, call["max_seqlen_q"],
            call["max_seqlen_kv"], mask, left, right, fab.bottom_right,
            float(self.softmax_scale) if self.softmax_scale is not None else q.shape[-1] ** -0.5,
            bool(self.deterministic),
        )  # fmt: skip
        if q_fmt != kv_fmt:
            out = out.transpose(0, 1)
        return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1]).contiguous()

    # ------------------------------------------------------------------------------ decisions
    def _decide(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                call: dict[str, Any]) -> BackendVersion:  # fmt: skip
        """Our decision for these inputs (the router called without one)."""
        params = _InputParams.build(self, q, k, v, call)
        use_flash, fab, use_fused, _, use_unfused, _ = get_attention_backend(params)
        if not use_flash or not isinstance(fab, BackendVersion):
            chosen = "fused" if use_fused else "unfused" if use_unfused else None
            raise RuntimeError(
                f"te-fl-attention FlashAttention router: the decision for these inputs chose "
                f"{_name(chosen)}, not a flash-tier "
                f"backend ({', '.join(flash_tier())}); run it through DotProductAttention or "
                "te-fl-attn explain for the reasons"
            )
        return fab


def refusal(backend: str, fab: BackendVersion, why: str) -> RuntimeError:
    """The router's refusal: the backend, why, and the decision it was given."""
    d = fab.decision
    try:
        reasons = "; ".join(f"[{r.stage}] {r.message}" for r in d.result(backend).reasons)
    except KeyError:
        reasons = ""
    return RuntimeError(
        f"te-fl-attention FlashAttention router refuses to run {_name(backend)}: "
        f"{why}. Decision on {d.device.name}: chosen {d.chosen!r}, flash-tier backends allowed: "
        f"{', '.join(fab.allowed) or 'none'}" + (f"; {backend}: {reasons}" if reasons else "")
    )


def tensor_formats(qkv_layout: str) -> tuple[str, str]:
    """The formats of the q and of the k/v tensors a layout names: ``sbhd_bshd_bshd`` ->
    (sbhd, bshd), ``thd_bshd_bshd`` -> (thd, bshd), ``bs3hd`` -> (bshd, bshd)."""
    parts = qkv_layout.replace("paged_kv_", "").split("_")
    q, kv = ("".join(c for c in p if c.isalpha()) for p in (parts[0], parts[-1]))
    return q, kv


def _window(window: Any) -> tuple[int, int] | None:
    return None if window is None else (int(window[0]), int(window[1]))


def _unsupported(call: dict[str, Any], dropout: bool) -> str | None:
    """The first feature of TE's call that our Triton kernel cannot run."""
    cp = call["cp_group"]
    checks = (
        ("ALiBi slopes", call["alibi_slopes"] is not None),
        ("dropout", dropout),
        ("FP8", bool(call["fp8"])),
        ("a KV cache (inference_params)", call["inference_params"] is not None),
        ("context parallelism", cp is not None and _world_size(cp) > 1),
        ("num_splits != 1", call["num_splits"] not in (None, 1)),
        ("softcap", bool(call.get("softcap") or 0.0)),
        ("an arbitrary mask", call["attn_mask_type"] == "arbitrary"),
    )
    return next((name for name, bad in checks if bad), None)


def _world_size(group: Any) -> int:
    groups = group if isinstance(group, list) else [group]
    size = 1
    for g in groups:
        size *= torch.distributed.get_world_size(g)
    return size


def _cu_seqlens_from_mask(mask: Any, q: torch.Tensor, k: torch.Tensor, fmt: str,
                          fab: BackendVersion) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cu_seqlens from TE's padding mask ([b, 1, 1, s], True = padding; a (q, kv) pair for
    cross-attention). Our kernel needs each sequence's tokens first, padding after."""
    if mask is None:
        raise refusal(fab.backend, fab, "a padding mask without cu_seqlens or attention_mask")
    masks = mask if isinstance(mask, (tuple, list)) else (mask, mask)
    bdim = 0 if fmt == "bshd" else 1
    out = []
    for m, x in zip(masks, (q, k), strict=True):
        keep = ~m.reshape(x.shape[bdim], -1)
        lens = keep.sum(dim=1, dtype=torch.int32)
        pos = torch.arange(keep.shape[1], device=keep.device)
        if not bool((keep == (pos.unsqueeze(0) < lens.unsqueeze(1))).all()):
            raise refusal(fab.backend, fab, "padding that is not at the end of each sequence")
        out.append(torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)))
    return out[0], out[1]


@dataclasses.dataclass
class _InputParams:
    """AttentionParams-like fields for inputs the router was handed without a decision."""

    qkv_type: type
    qkv_dtype: torch.dtype
    qkv_layout: str
    batch_size: Any
    num_heads: int
    num_gqa_groups: int
    max_seqlen_q: Any
    max_seqlen_kv: Any
    head_dim_qk: int
    head_dim_v: int
    attn_mask_type: str
    window_size: Any
    alibi_slopes_shape: Any
    core_attention_bias_type: str
    attention_dropout: float
    context_parallel: bool
    cp_comm_type: str
    deterministic: bool
    is_training: bool
    fp8: bool
    fp8_meta: Any
    inference_params: Any
    pad_between_seqs: bool
    num_splits: int
    softcap: float
    softmax_scale: Any

    @classmethod
    def build(cls, router: FlashAttentionRouter, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, call: dict[str, Any]) -> _InputParams:  # fmt: skip
        q_fmt, kv_fmt = tensor_formats(call["qkv_layout"])
        if q_fmt == "thd":
            cu_q = call["cu_seqlens_q"]
            batch = cu_q.shape[0] - 1
            sq = call["max_seqlen_q"] or int((cu_q[1:] - cu_q[:-1]).max())
        else:
            batch, sq = (q.shape[0], q.shape[1]) if q_fmt == "bshd" else (q.shape[1], q.shape[0])
        if kv_fmt == "thd":
            cu_kv = call["cu_seqlens_kv"]
            skv = call["max_seqlen_kv"] or int((cu_kv[1:] - cu_kv[:-1]).max())
        else:
            skv = k.shape[1] if kv_fmt == "bshd" else k.shape[0]
        alibi = call["alibi_slopes"]
        cp = call["cp_group"]
        return cls(
            qkv_type=type(q), qkv_dtype=q.dtype, qkv_layout=call["qkv_layout"], batch_size=batch,
            num_heads=q.shape[-2], num_gqa_groups=k.shape[-2], max_seqlen_q=sq,
            max_seqlen_kv=skv, head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1],
            attn_mask_type=call["attn_mask_type"], window_size=call["window_size"],
            alibi_slopes_shape=None if alibi is None else alibi.shape,
            core_attention_bias_type="alibi" if alibi is not None else "no_bias",
            attention_dropout=router.attention_dropout,
            context_parallel=cp is not None and _world_size(cp) > 1,
            cp_comm_type=call["cp_comm_type"], deterministic=router.deterministic,
            is_training=router.training, fp8=bool(call["fp8"]), fp8_meta=call["fp8_meta"],
            inference_params=call["inference_params"],
            pad_between_seqs=bool(call["pad_between_seqs"]), num_splits=call["num_splits"] or 1,
            softcap=float(call.get("softcap") or 0.0), softmax_scale=router.softmax_scale,
        )  # fmt: skip


# ---------------------------------------------------------------------------------- Triton
def _features(cu_q: Any, cu_kv: Any, cu_qp: Any, cu_kvp: Any, fmt: str, max_q: Any, max_kv: Any,
              mask: str, left: int, right: int, bottom_right: bool, scale: float,
              deterministic: bool) -> dict[str, Any]:  # fmt: skip
    return dict(qkv_format=fmt, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_qp,
                cu_seqlens_kv_padded=cu_kvp, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                attn_mask_type=mask, window_size=(left, right),
                bottom_right_diagonal=bottom_right, softmax_scale=scale,
                deterministic=deterministic)  # fmt: skip


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: dict[str, Any],
         name: str = "triton") -> torch.Tensor:  # fmt: skip
    from ..kernels.run import run

    return run(name, q, k, v, **features)


def _attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
               ) -> torch.Tensor:  # fmt: skip
    """A registered kernel of ours other than Triton on q/k/v, in eager mode (no custom op:
    under torch.compile dynamo traces into its runner)."""
    return _run(q, k, v, _features(*args), name)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Any, cu_kv: Any,
                     cu_qp: Any, cu_kvp: Any, fmt: str, max_q: Any, max_kv: Any, mask: str,
                     left: int, right: int, bottom_right: bool, scale: float,
                     deterministic: bool) -> torch.Tensor:  # fmt: skip
    """Our Triton kernel on q/k/v in ``fmt``: the kernel's autograd Function in eager mode, the
    custom op ``te_fl_attention::triton_attention`` under torch.compile."""
    if torch.compiler.is_compiling() and _OP_READY:
        return torch.ops.te_fl_attention.triton_attention(
            q, k, v, cu_q, cu_kv, cu_qp, cu_kvp, fmt, max_q, max_kv, mask, left, right,
            bottom_right, scale, deterministic)  # fmt: skip
    return _run(q, k, v, _features(cu_q, cu_kv, cu_qp, cu_kvp, fmt, max_q, max_kv, mask, left,
                                   right, bottom_right, scale, deterministic))  # fmt: skip


def _register_op() -> bool:
    """``te_fl_attention::triton_attention`` (+ its backward op), registered once per process.
    False on a torch without ``torch.library.custom_op`` (< 2.4): compiled code then calls the
    kernel directly (a graph break)."""
    if not hasattr(torch.library, "custom_op"):
        return False
    if hasattr(torch.ops.te_fl_attention, "triton_attention"):
        return True
    args = ("Tensor q, Tensor k, Tensor v, Tensor? cu_q, Tensor? cu_kv, Tensor? cu_qp, "
            "Tensor? cu_kvp, str fmt, SymInt? max_q, SymInt? max_kv, str mask, int left, "
            "int right, bool bottom_right, float scale, bool deterministic")

    @torch.library.custom_op("te_fl_attention::triton_attention", mutates_args=(),
                             schema=f"({args}) -> Tensor")
    def fwd(q, k, v, cu_q, cu_kv, cu_qp, cu_kvp, fmt, max_q, max_kv, mask, left, right,
            bottom_right, scale, deterministic):  # type: ignore[no-untyped-def]  # fmt: skip
        feats = _features(cu_q, cu_kv, cu_qp, cu_kvp, fmt, max_q, max_kv, mask, left, right,
                          bottom_right, scale, deterministic)  # fmt: skip
        with torch.no_grad():
            return _run(q, k, v, feats).contiguous()

    @fwd.register_fake
    def _(q, k, v, *args):  # type: ignore[no-untyped-def]
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    @torch.library.custom_op("te_fl_attention::triton_attention_backward", mutates_args=(),
                             schema=f"(Tensor grad, {args}) -> (Tensor, Tensor, Tensor)")
    def bwd(grad, q, k, v, cu_q, cu_kv, cu_qp, cu_kvp, fmt, max_q, max_kv, mask, left, right,
            bottom_right, scale, deterministic):  # type: ignore[no-untyped-def]  # fmt: skip
        feats = _features(cu_q, cu_kv, cu_qp, cu_kvp, fmt, max_q, max_kv, mask, left, right,
                          bottom_right, scale, deterministic)  # fmt: skip
        with torch.enable_grad():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = _run(qq, kk, vv, feats)
            grads = torch.autograd.grad(out, (qq, kk, vv), grad)
        return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]

    @bwd.register_fake
    def _(grad, q, k, v, *args):  # type: ignore[no-untyped-def]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        q, k, v, cu_q, cu_kv, cu_qp, cu_kvp, *scalars = inputs
        ctx.save_for_backward(q, k, v, cu_q, cu_kv, cu_qp, cu_kvp)
        ctx.scalars = scalars

    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        saved = ctx.saved_tensors
        dq, dk, dv = torch.ops.te_fl_attention.triton_attention_backward(
            grad.contiguous(), *saved, *ctx.scalars)
        return (dq, dk, dv, *([None] * (4 + len(ctx.scalars))))

    fwd.register_autograd(backward, setup_context=setup_context)
    return True


_OP_READY = _register_op()

#: TE's name for the class (what ``tex.flash_attention`` is).
FlashAttention = FlashAttentionRouter

__all__ = ["FlashAttentionRouter", "FlashAttention", "triton_attention", "refusal"]
