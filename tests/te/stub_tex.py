"""A CPU stand-in for TransformerEngine's compiled extension ``transformer_engine_torch``.

TE's real ``load_framework_extension("torch")`` loads this file as its extension (the test boot,
:mod:`te_boot`, points ``transformer_engine.common._get_shared_object_file("torch")`` here);
with ``NVTE_PLUGIN`` set, TE registers it as ``transformer_engine_torch_nv`` before calling the
plugin. It exposes exactly the names TE's PyTorch sources use from the extension (anything else
is an ``AttributeError``, as with the real module):

* CamelCase names are ``IntEnum`` classes with the members TE's sources spell (``DType`` has
  exactly TE's eight members, ``NVTE_Fused_Attn_Backend`` TE's values);
* ``get_cudnn_version()`` returns 92801 (cuDNN 9.28.1);
* ``get_fused_attn_backend(params)`` (TE's C++ cuDNN support query) is answered by
  te-fl-attention's cuDNN support table (``probes.fused.table.TABLE_RULES``) for :data:`DEVICE`
  (:class:`GraphFusedBackend` answers it with cuDNN's deviceless graph build instead, for
  ``benchmarks/te_sweep.py``);
* every other function raises ``NotImplementedError`` naming itself (``STUB_MARKER`` in the
  message), which lets tests prove that a call reached the native module.

Importing this file has no side effects; TE's sources are scanned on first attribute access.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

STUB_MARKER = "te-fl-attention CPU stub of transformer_engine_torch"
CUDNN_VERSION = 92801

#: ``tex.DType`` (TE's constants.py asserts this exact member set); values as NVTEDType.
DTYPE_MEMBERS = {
    "kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6,
    "kFloat8E4M3": 7, "kFloat8E5M2": 8, "kFloat4E2M1": 10,
}  # fmt: skip
FIXED_ENUMS = {
    "NVTE_Fused_Attn_Backend": {"NVTE_No_Backend": -1, "NVTE_F16_arbitrary_seqlen": 1,
                                "NVTE_FP8": 2},
}  # fmt: skip
_RESERVED = set(dir(int)) | set(dir(enum.IntEnum)) | {"mro"}
_USE_RE = re.compile(r"\b(?:tex|transformer_engine_torch)\.([A-Za-z_][A-Za-z0-9_]*)")
_MEMBER_RE = re.compile(r"\b([A-Z][A-Za-z0-9_]*)\.([A-Za-z][A-Za-z0-9_]*)\b")

#: The device the fused-backend query answers for (a te_fl_attention profile spec or profile).
DEVICE: Any = os.environ.get("TE_FL_ATTN_DEVICE") or "h100"


def _te_pytorch() -> Path:
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("transformer-engine is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pytorch"


@functools.lru_cache(maxsize=1)
def _sources() -> tuple[frozenset[str], dict[str, tuple[str, ...]]]:
    """(names TE uses from the extension, CamelCase name -> members TE spells)."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for path in _te_pytorch().rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        names.update(_USE_RE.findall(text))
        if "transformer_engine_torch" in text:
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module == "transformer_engine_torch":
                    names.update(a.name for a in node.names if a.name != "*")
        for name, member in _MEMBER_RE.findall(text):
            if member not in _RESERVED and not member.startswith("_"):
                members.setdefault(name, set()).add(member)
    return frozenset(names), {k: tuple(sorted(v)) for k, v in members.items()}


def _enum(name: str) -> type[enum.IntEnum]:
    if name == "DType":
        return enum.IntEnum(name, DTYPE_MEMBERS)
    values = FIXED_ENUMS.get(name)
    if values is None:
        values = {m: i for i, m in enumerate(_sources()[1].get(name, ()))}
    return enum.IntEnum(name, values)


def _placeholder(name: str) -> Any:
    def placeholder(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"transformer_engine_torch.{name}: {STUB_MARKER}")

    placeholder.__name__ = placeholder.__qualname__ = name
    placeholder.__module__ = "transformer_engine_torch"
    return placeholder


def __getattr__(name: str) -> Any:
    if name == "__all__":  # what TE uses, and what it reads through cpp_extensions' star import
        own = {"get_cudnn_version", "get_fused_attn_backend"}
        return sorted({n for n in _sources()[0] if not n.startswith("_")} | own)
    if name.startswith("__") or name not in _sources()[0]:
        raise AttributeError(f"module 'transformer_engine_torch' has no attribute {name!r}")
    value = _enum(name) if name[:1].isupper() else _placeholder(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _sources()[0])


def get_cudnn_version() -> int:
    return CUDNN_VERSION


def get_fused_attn_backend(params: Any) -> tuple[int, str]:
    """TE's C++ cuDNN support query, answered by our cuDNN support table for :data:`DEVICE`."""
    from te_fl_attention.device import profile

    return table_fused_backend(params, profile(DEVICE))


# ------------------------------------------------------------------------ the table oracle
def _names(table: dict) -> dict[str, Any]:
    """TE's name -> enum member dict, inverted by member name."""
    return {getattr(member, "name", str(member)): key for key, member in table.items()}


@functools.lru_cache(maxsize=1)
def _tables() -> dict[str, dict[str, Any]]:
    import transformer_engine.pytorch.cpp_extensions.fused_attn as fa

    return {
        "layout": _names(fa.QKVLayout), "mask": _names(fa.AttnMaskType),
        "bias": _names(fa.AttnBiasType), "softmax": _names(fa.SoftmaxType),
    }  # fmt: skip


_DTYPES = {"kFloat16": "fp16", "kBFloat16": "bf16", "kFloat32": "fp32",
           "kFloat8E4M3": "fp8_e4m3", "kFloat8E5M2": "fp8_e5m2"}  # fmt: skip


def _fp8_recipe(params: Any) -> str:
    """The recipe behind an FP8 query, from what TE's ``get_fused_attn_spec`` passes: MXFP8
    block scaling, else per-tensor scaling with dQKV in FP8 (delayed) or 16-bit (current; its O
    16-bit too unless ``NVTE_DPA_FP8CS_O_in_F16=0``, which the config cannot state)."""
    if "MXFP8" in getattr(params.scaling_mode, "name", ""):
        return "mxfp8"
    dqkv = getattr(params.dqkv_dtype, "name", str(params.dqkv_dtype))
    return "delayed" if dqkv in ("kFloat8E4M3", "kFloat8E5M2") else "current"


def fused_params_config(params: Any) -> Any:
    """TE's ``FusedAttentionParams`` (what the C++ query receives) as a FusedAttnConfig."""
    from te_fl_attention.config import FusedAttnConfig
    from te_fl_attention.config_te import _bias_shape_code

    t = _tables()
    dtype = _DTYPES[getattr(params.qkv_dtype, "name", str(params.qkv_dtype))]
    fp8 = dtype.startswith("fp8")
    layout = t["layout"][params.qkv_layout.name]
    bias = t["bias"][params.bias_type.name]
    b, h, sq = params.batch_size, params.num_attn_heads, params.max_seqlen_q
    shape = None
    if bias in ("pre_scale_bias", "post_scale_bias") and params.bias_seqlen_kv:
        shape = _bias_shape_code((params.bias_batch_size, params.bias_num_heads,
                                  params.bias_seqlen_q, params.bias_seqlen_kv), b, h, sq)
    paged = params.num_pages_k > 0
    return FusedAttnConfig(
        batch_size=b, max_seqlen_q=sq, max_seqlen_kv=params.max_seqlen_kv, num_heads=h,
        num_gqa_groups=params.num_gqa_groups, head_dim_qk=params.head_dim_qk,
        head_dim_v=params.head_dim_v, dtype=dtype, qkv_layout=layout,
        attn_mask_type=t["mask"][params.attn_mask_type.name],
        window_size=(params.window_size_left, params.window_size_right),
        bottom_right_diagonal=bool(params.bottom_right_diagonal), bias_type=bias,
        bias_shape=shape, dropout=float(params.dropout),
        softmax_type=t["softmax"][params.softmax_type.name], is_training=bool(params.is_training),
        deterministic=bool(params.deterministic), fp8=fp8,
        fp8_recipe=_fp8_recipe(params) if fp8 else "none",
        kv_cache=paged, paged=paged, page_size=params.page_size_k if paged else 0,
        return_max_logit=bool(params.return_max_logit), cuda_graph=bool(params.cuda_graph),
        # q.shape[0] / k.shape[0] of a thd tensor (0 otherwise, and 0 stays 0 for thd: TE's C++
        # refuses it); the config keeps TE's bucket of it (get_max_tokens), which the graph uses
        num_tokens_q=int(params.num_tokens_q), num_tokens_kv=int(params.num_tokens_kv),
        softmax_scale=float(params.attn_scale),
    )  # fmt: skip


def table_fused_backend(params: Any, device: Any) -> tuple[int, str]:
    """(sub-backend or -1, message): our cuDNN support table's verdict on TE's query."""
    from te_fl_attention.probes.base import evaluate
    from te_fl_attention.probes.fused.rules import fused_sub_backend
    from te_fl_attention.probes.fused.table import TABLE_RULES

    try:
        config = fused_params_config(params)
    except (ValueError, KeyError) as exc:
        return -1, f"not expressible as a FusedAttnConfig: {exc}"
    reasons = evaluate(TABLE_RULES, config, device)
    if reasons:
        return -1, "; ".join(r.message for r in reasons)
    return fused_sub_backend(config), ""


class GraphFusedBackend:
    """TE's C++ cuDNN query answered by cuDNN itself: the deviceless graph build
    (``probes.fused.graph.probe_config``, in a probe worker) of the config TE's query receives
    (after TE's Python rewrites: ALiBi with custom slopes as ``post_scale_bias``, thd token counts,
    one call per context-parallel step). Memoizing identical queries is the worker's business
    (``benchmarks/te_sweep.MemoWorker`` serves both sides of the sweep).

    ``__call__(params, device)`` gives ``(sub-backend or -1, message)`` as the C++ query does.
    Where cuDNN cannot be asked (no cudnn-frontend, a graph the probe cannot express, a worker
    failure) the support table answers instead, and ``undecided`` counts it by code."""

    def __init__(self, worker: Any = None, timeout_s: float = 60.0) -> None:
        self.worker = worker
        self.timeout_s = timeout_s
        self.undecided: dict[str, int] = {}

    def _worker(self) -> Any:
        if self.worker is None:
            from te_fl_attention.probes.fused.worker import CudnnWorker

            self.worker = CudnnWorker()
        return self.worker

    def answer(self, config: Any, device: Any) -> dict[str, Any]:
        """The worker's graph result for ``config`` on ``device``."""
        from te_fl_attention.descriptors import descriptor_for

        return self._worker().probe(config.to_dict(), descriptor_for(device, None), device.sm,
                                    timeout_s=self.timeout_s)  # fmt: skip

    def __call__(self, params: Any, device: Any) -> tuple[int, str]:
        from te_fl_attention.probes.fused.rules import fused_sub_backend

        try:
            config = fused_params_config(params)
        except (ValueError, KeyError) as exc:
            return -1, f"not expressible as a FusedAttnConfig: {exc}"
        result = self.answer(config, device)
        if not result.get("decided"):
            code = str(result.get("code") or "cudnn.undecided")
            self.undecided[code] = self.undecided.get(code, 0) + 1
            return table_fused_backend(params, device)
        if result.get("supported"):
            return fused_sub_backend(config), ""
        text = (result.get("summary") or result.get("message") or "").strip()
        where = f"{result.get('graph') or '?'}.{result.get('step') or '?'}"
        return -1, f"cuDNN graph build refused ({where}): {text[:500]}"
