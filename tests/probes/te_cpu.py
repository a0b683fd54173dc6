"""Run TransformerEngine 2.20.2's real ``get_attention_backend`` on a CPU-only machine.

TE is a test dependency: :func:`load` imports it once per process (``NVTE_PROJECT_BUILDING=1``,
a stub ``transformer_engine_torch`` module, a no-op ``load_framework_extension``) and raises
loudly when it cannot. :class:`TE` then answers "what would TE pick" for one
:class:`~te_fl_attention.config.FusedAttnConfig` on one
:class:`~te_fl_attention.device.DeviceProfile`, with the device's compute capability, cuDNN
version and installed flash-attn flavours patched in. The C++ cuDNN query
(``tex.get_fused_attn_backend``) cannot run here: it is answered by :func:`cpp_prechecks`, an
oracle of what TE 2.20.2's ``nvte_get_fused_attn_backend_v2`` refuses *before* it builds a cuDNN
graph (written from TE's C++, independently of our rules), and "supported" otherwise, so that TE's
Python-side rules and its C++ pre-graph refusals speak, never cuDNN itself.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import DeviceProfile

TE_VERSION = "2.20.2"

#: ``tex.DType`` must have exactly these members (TE's constants.py asserts it); values as in
#: TE's ``transformer_engine.h`` (``NVTEDType``).
DTYPE_MEMBERS = {
    "kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6,
    "kFloat8E4M3": 7, "kFloat8E5M2": 8, "kFloat4E2M1": 10,
}  # fmt: skip

#: Enums whose values matter to the selection logic (TE compares them to ints).
FIXED_ENUMS = {
    "NVTE_Fused_Attn_Backend": {
        "NVTE_No_Backend": -1, "NVTE_F16_arbitrary_seqlen": 1, "NVTE_FP8": 2,
    },
}  # fmt: skip

#: TE's env switches that change ``get_attention_backend``'s answer; cleared while it runs.
TE_ENV = (
    "NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V2", "NVTE_FLASH_ATTN_V3", "NVTE_FLASH_ATTN_V4",
    "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_UnfusedDPA_Emulate_FP8", "NVTE_FP8_DPA_BWD",
    "NVTE_DPA_FP8_RECIPE", "NVTE_DPA_FP8CS_O_in_F16", "NVTE_PLUGIN",
)  # fmt: skip

_RESERVED = set(dir(int)) | set(dir(enum.IntEnum)) | {"mro"}
_MEMBER_RE = re.compile(r"\b([A-Z][A-Za-z0-9_]*)\.([A-Za-z][A-Za-z0-9_]*)\b")


def _te_root() -> Path:
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "transformer-engine is not installed; it is a test dependency: "
            f"pip install transformer-engine=={TE_VERSION} transformer-engine-cu12=={TE_VERSION}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@functools.lru_cache(maxsize=1)
def _touched_members() -> dict[str, list[str]]:
    """Every ``CamelName.member`` spelled in TE's PyTorch sources (the members TE touches)."""
    found: dict[str, set[str]] = {}
    for path in (_te_root() / "pytorch").rglob("*.py"):
        for name, member in _MEMBER_RE.findall(path.read_text(encoding="utf-8")):
            if member not in _RESERVED and not member.startswith("_"):
                found.setdefault(name, set()).add(member)
    return {k: sorted(v) for k, v in found.items()}


def _enum(name: str) -> type[enum.IntEnum]:
    if name == "DType":
        return enum.IntEnum(name, DTYPE_MEMBERS)
    values = FIXED_ENUMS.get(name)
    if values is None:
        members = _touched_members().get(name, [])
        values = {m: i for i, m in enumerate(members)}
    return enum.IntEnum(name, values)


def _placeholder(name: str) -> Callable[..., Any]:
    def placeholder(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"transformer_engine_torch.{name} is a CPU test stub")

    placeholder.__name__ = name
    return placeholder


class StubExtension(types.ModuleType):
    """``transformer_engine_torch`` without CUDA: CamelCase names are IntEnums (members as TE's
    sources spell them), everything else a callable placeholder; both created on first use."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = _enum(name) if name[:1].isupper() else _placeholder(name)
        setattr(self, name, value)
        return value


class _Anything:
    """Stands for any triton object at import time: decorators return the function they wrap;
    calls, attributes and subscripts give another placeholder."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], types.FunctionType):
            return args[0]
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key: Any) -> Any:
        return self


class _AnythingModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def _stub_te_triton_kernels() -> None:
    """TE's PyTorch package imports its Triton kernels (``transformer_engine.{pytorch,common}.
    triton``) at import time. Without triton installed, those TE modules are replaced by
    placeholders; ``triton`` itself is never faked (torch probes for it)."""
    if importlib.util.find_spec("triton") is not None:
        return
    kernels = ("cross_entropy", "grouped_dbias_dscales", "mhc", "pad", "permutation")
    for pkg in ("transformer_engine.pytorch.triton", "transformer_engine.common.triton"):
        parent = _AnythingModule(pkg)
        parent.__path__ = []
        sys.modules[pkg] = parent
        for k in kernels:
            sys.modules[f"{pkg}.{k}"] = mod = _AnythingModule(f"{pkg}.{k}")
            setattr(parent, k, mod)


@contextlib.contextmanager
def _env(clear: tuple[str, ...], **set_: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*clear, *set_)}
    try:
        for k in clear:
            os.environ.pop(k, None)
        os.environ.update(set_)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@functools.lru_cache(maxsize=1)
def load() -> types.SimpleNamespace:
    """Import TE's PyTorch attention utilities on CPU (once per process). Raises on failure."""
    installed = metadata.version("transformer-engine")
    if installed != TE_VERSION:
        raise RuntimeError(f"these parity tests target transformer-engine {TE_VERSION}, "
                           f"found {installed}")  # fmt: skip
    stub = StubExtension("transformer_engine_torch")
    stub.__file__ = __file__
    previous = sys.modules.get("transformer_engine_torch")
    sys.modules["transformer_engine_torch"] = stub
    try:
        with _env(("NVTE_PLUGIN",), NVTE_PROJECT_BUILDING="1"), warnings.catch_warnings():
            # "could not find the shared object file", "FlashAttention 4 ... cannot be loaded"
            warnings.simplefilter("ignore", RuntimeWarning)
            _stub_te_triton_kernels()
            import transformer_engine.common as te_common

            te_common.load_framework_extension = lambda framework: None
            importlib.import_module("transformer_engine.pytorch")
            utils = importlib.import_module(
                "transformer_engine.pytorch.attention.dot_product_attention.utils"
            )
            recipe = importlib.import_module("transformer_engine.common.recipe")
            fused = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
    except BaseException:
        if previous is None:
            sys.modules.pop("transformer_engine_torch", None)
        else:
            sys.modules["transformer_engine_torch"] = previous
        raise
    return types.SimpleNamespace(tex=stub, utils=utils, recipe=recipe, fused=fused)


# ------------------------------------------------------------------------------ flash-attn-4
def _fa4_validator() -> tuple[Callable[..., None], str]:
    """flash-attn-4's ``_validate_head_dims``: imported, or compiled from the installed source
    (the module itself needs CUTLASS DSL, which a CPU machine may lack), or a stand-in."""
    try:
        from flash_attn.cute.interface import _validate_head_dims  # type: ignore

        return _validate_head_dims, "imported"
    except Exception:  # noqa: BLE001 - cutlass missing etc.
        pass
    try:
        files = metadata.files("flash-attn-4") or []
        src = next(f for f in files if str(f).endswith("flash_attn/cute/interface.py"))
        tree = ast.parse(Path(src.locate()).read_text(encoding="utf-8"))
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == "_validate_head_dims")  # fmt: skip
        fn.decorator_list = []  # an lru_cache: no change to what it accepts
        ns: dict[str, Any] = {}
        exec(compile(ast.Module([fn], []), str(src.locate()), "exec"), ns)  # noqa: S102
        return ns["_validate_head_dims"], "source"
    except (metadata.PackageNotFoundError, StopIteration, OSError, SyntaxError):
        return _validate_head_dims_standin, "stand-in"


def _validate_head_dims_standin(head_dim: int, head_dim_v: int, cc: int, alignment: int) -> None:
    """flash-attn-4 4.0.0b36's rule: sm90 8..256; sm100/110 <= 128, (192, 128), (256, 256),
    (64 or d, 512); both dims divisible by ``alignment``; other archs unchecked."""
    aligned = head_dim % alignment == 0 and head_dim_v % alignment == 0
    if cc == 9:
        assert 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and aligned
    elif cc in (10, 11):
        assert aligned and (
            (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128)
            or (head_dim, head_dim_v) in ((192, 128), (256, 256))
            or ((head_dim == 64 or head_dim == head_dim_v) and head_dim_v == 512)
        )


# ------------------------------------------------------------------------- config conversion
@dataclass
class _CacheManager:
    max_pages_per_seq: int


@dataclass
class InferenceParamsStandIn:
    """The attributes of TE's ``InferenceParams`` that ``get_attention_backend`` reads."""

    is_paged: bool
    page_size: int | None
    total_num_pages: int | None
    cache_manager: _CacheManager | None


_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32",
                 "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # fmt: skip
_RECIPES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling",
            "mxfp8": "MXFP8BlockScaling", "block": "Float8BlockScaling",
            "nvfp4": "NVFP4BlockScaling"}  # fmt: skip


def _bias_shape(c: FusedAttnConfig) -> tuple[int, int, int, int] | None:
    code = c.bias_shape
    if code is None:
        return None
    b, h, sq, skv = c.batch_size, c.num_heads, c.max_seqlen_q, c.max_seqlen_kv
    return {
        "bhss": (b, h, sq, skv), "1hss": (1, h, sq, skv), "b1ss": (b, 1, sq, skv),
        "11ss": (1, 1, sq, skv), "111s": (1, 1, 1, skv),
    }[code]  # fmt: skip


def attention_params(te: types.SimpleNamespace, c: FusedAttnConfig) -> Any:
    """TE's ``AttentionParams`` for a config, as ``DotProductAttention.forward`` would build it."""
    import torch

    fp8_meta = None
    qkv_type: Any = torch.Tensor
    nominal = None
    qkv_dtype = getattr(torch, _TORCH_DTYPES[c.dtype])
    if c.fp8:
        recipe = getattr(te.recipe, _RECIPES[c.fp8_recipe])()
        # Float8BlockScaling/NVFP4BlockScaling refuse fp8_dpa at construction; set it afterwards
        # so that get_attention_backend's own filter for them is exercised too.
        recipe.fp8_dpa, recipe.fp8_mha = True, c.fp8_mha
        fp8_meta = {"recipe": recipe}
        if c.fp8_mha and c.fp8_recipe in ("delayed", "current"):
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

            qkv_type = Float8Tensor  # its .dtype is the nominal (model) dtype
        if c.dtype in ("fp8_e4m3", "fp8_e5m2"):
            nominal = torch.bfloat16
    inference = None
    if c.kv_cache:
        if c.paged:
            pages_per_seq = -(-c.max_seqlen_kv // c.page_size)
            inference = InferenceParamsStandIn(True, c.page_size, pages_per_seq * c.batch_size,
                                               _CacheManager(pages_per_seq))  # fmt: skip
        else:
            inference = InferenceParamsStandIn(False, None, None, None)
    # TE passes q.shape[0] / k.shape[0] of a thd tensor, else 0 (dot_product_attention.py); the
    # config holds TE's bucket of it (a count TE could be handed: padding included).
    thd_q = c.q_format == "thd"
    thd_kv = c.kv_format == "thd"
    tokens_q = getattr(c, "num_tokens_q", None) or c.batch_size * c.max_seqlen_q
    tokens_kv = getattr(c, "num_tokens_kv", None) or c.batch_size * c.max_seqlen_kv
    return te.utils.AttentionParams(
        qkv_type=qkv_type,
        qkv_dtype=qkv_dtype,
        nominal_dtype=nominal,
        qkv_layout=c.qkv_layout,
        batch_size=c.batch_size,
        num_heads=c.num_heads,
        num_gqa_groups=c.num_gqa_groups,
        max_seqlen_q=c.max_seqlen_q,
        max_seqlen_kv=c.max_seqlen_kv,
        num_tokens_q=tokens_q if thd_q else 0,
        num_tokens_kv=tokens_kv if thd_kv else 0,
        head_dim_qk=c.head_dim_qk,
        head_dim_v=c.head_dim_v,
        attn_mask_type=c.attn_mask_type,
        window_size=c.window_size,
        bottom_right_diagonal=c.bottom_right_diagonal,
        softcap=c.softcap,
        alibi_slopes_shape=list(c.alibi_slopes_shape) if c.alibi_slopes_shape else None,
        core_attention_bias_type=c.bias_type,
        core_attention_bias_shape=_bias_shape(c),
        core_attention_bias_requires_grad=c.bias_requires_grad,
        pad_between_seqs=c.pad_between_seqs,
        attention_dropout=c.dropout,
        context_parallel=c.context_parallel,
        cp_comm_type=c.cp_comm_type,
        cp_size=c.cp_size,
        cp_size_a2a=2 if c.cp_comm_type == "a2a+p2p" and c.cp_size % 2 == 0 else 1,
        deterministic=c.deterministic,
        is_training=c.is_training,
        fp8=c.fp8,
        fp8_meta=fp8_meta,
        inference_params=inference,
        softmax_type=c.softmax_type,
        return_max_logit=c.return_max_logit,
        cuda_graph=c.cuda_graph,
        num_splits=c.num_splits,
        softmax_scale=c.scale,
        fp8_output=c.fp8_output,
        checkpoint_core_attention=c.checkpoint_core_attention,
        has_score_mod=c.has_score_mod,
        has_score_mod_bprop=c.has_score_mod_bprop,
    )


# ------------------------------------------------------------ TE's C++ refusals, as an oracle
#: TE 2.20.2's C++ FP8 query accepts these q/k/v formats (nvte_get_qkv_format values).
_FP8_FORMATS = ("bshd", "sbhd", "thd", "bhsd")


def _member(value: Any) -> str:
    return getattr(value, "name", str(value))


def _cpp_formats(layout: Any) -> tuple[str, str, bool] | None:
    """(q format, kv format, paged) of an ``NVTE_QKV_Layout`` member, read as TE's C++ reads it
    (``nvte_get_q_format`` / ``nvte_get_kv_format``); None for ``NOT_SET``."""
    name = _member(layout)
    if name.endswith("NOT_SET"):
        return None
    text = name.removeprefix("NVTE_").lower()
    paged = text.startswith("paged_kv_")
    groups = text.removeprefix("paged_kv_").split("_")
    letters = ["".join(ch for ch in g if ch.isalpha()) for g in groups]
    return letters[0], letters[-1], paged


def cpp_prechecks(p: Any, sm: int, cudnn: tuple[int, int, int]) -> tuple[str, str] | None:
    """``(key, message)`` for the first refusal of TE 2.20.2's ``nvte_get_fused_attn_backend_v2``
    (fused_attn.cpp) before it builds any cuDNN graph, for the ``FusedAttentionParams`` ``p``
    that TE's Python hands it, or None when TE would go on to ask cuDNN. Written from TE's C++ (the
    2.20.2 binary; /work/notes/te_cpp_fused_attn.md section 10), in TE's order, first hit wins."""
    formats = _cpp_formats(p.qkv_layout)
    assert formats is not None, "TE always sets qkv_layout"
    q_fmt, kv_fmt, paged = formats
    ragged_q, ragged_kv = q_fmt == "thd", kv_fmt == "thd"
    mask, bias, softmax = _member(p.attn_mask_type), _member(p.bias_type), _member(p.softmax_type)
    padding = "PADDING" in mask
    training = bool(p.is_training)  # check_bwd is never set from Python: it defaults to true
    if (ragged_q or ragged_kv) and not padding:
        return "thd_mask", "THD format requires a PADDING* mask"
    if (ragged_q and p.num_tokens_q == 0) or (ragged_kv and p.num_tokens_kv == 0):
        return "thd_num_tokens", "THD format requires num_tokens_q / num_tokens_kv"
    if paged and not padding:
        return "paged_mask", "Paged KV requires a PADDING* mask"
    if paged and 0 in (p.num_pages_k, p.num_pages_v, p.page_size_k, p.page_size_v,
                       p.max_pages_per_seq_k, p.max_pages_per_seq_v):  # fmt: skip
        return "paged_dims", "Paged KV requires num_pages, page_size and max_pages_per_seq"
    if bias == "NVTE_PRE_SCALE_BIAS":
        return "pre_scale_bias", "Fused attention does not support pre-scale bias"
    qkv_format = q_fmt if q_fmt == kv_fmt else f"{q_fmt}_2{kv_fmt}"
    dtype = _member(p.qkv_dtype)
    if dtype in ("kFloat16", "kBFloat16"):
        if ragged_q and ragged_kv and sm <= 89:
            return "thd_sm90", "F16/BF16 fused attention with THD format requires sm90 or later"
        if (cudnn <= (9, 15, 0) and training and qkv_format in ("bshd", "sbhd")
                and p.max_seqlen_kv % 128 != 0 and p.cuda_graph and not padding):  # fmt: skip
            return "cuda_graph_cudnn", "Known cuDNN <= 9.15 issue with CUDA graph"
        ragged_stats = ragged_q and sm >= 90 and sm != 120
        if training and ragged_stats and softmax == "NVTE_LEARNABLE_SOFTMAX" \
                and cudnn < (9, 26, 0):  # fmt: skip
            return "thd_learnable_bwd", "Known cuDNN < 9.26.0 issue with THD learnable softmax"
        return None
    if dtype not in ("kFloat8E4M3", "kFloat8E5M2"):
        return "dtype", f"Unsupported QKV dtype qkv_dtype={dtype}"
    if p.return_max_logit:
        return "fp8_max_logit", "FP8 fused attention does not support return_max_logit=True"
    grad = _cpp_formats(p.dqkv_layout)
    grad_format = None if grad is None else (grad[0] if grad[0] == grad[1]
                                              else f"{grad[0]}_2{grad[1]}")  # fmt: skip
    if qkv_format not in _FP8_FORMATS:
        return "fp8_format", f"FP8 fused attention supports BSHD/SBHD/BHSD/THD, found {qkv_format}"
    if training and grad_format is not None and grad_format not in _FP8_FORMATS:
        return "fp8_format", f"FP8 gradient formats BSHD/SBHD/BHSD/THD, found {grad_format}"
    if qkv_format == "thd":
        if cudnn < (9, 23, 0):
            return "fp8_thd_cudnn", "FP8 with THD format requires cuDNN 9.23.0"
        if training and sm < 100:
            return "fp8_thd_bwd_sm", "FP8 THD format supports backward on sm100+ only"
        if training and softmax != "NVTE_VANILLA_SOFTMAX" and cudnn < (9, 26, 0):
            return "fp8_thd_softmax", "FP8 THD with a sink token requires cuDNN 9.26.0 (bwd)"
        if sm >= 100 and (p.head_dim_qk > 128 or p.head_dim_v > 128):
            return "fp8_thd_head_dim", "FP8 THD supports head dimensions up to 128 on sm100+"
    if bias == "NVTE_POST_SCALE_BIAS":
        return "fp8_bias", "FP8 fused attention does not support pre/post_scale_bias yet"
    if bias == "NVTE_ALIBI":
        return "fp8_alibi", "FP8 fused attention does not support ALiBi yet"
    f8 = ("kFloat8E4M3", "kFloat8E5M2")
    mode = _member(p.scaling_mode)
    tensor, mx = mode == "NVTE_DELAYED_TENSOR_SCALING", mode == "NVTE_MXFP8_1D_SCALING"
    o_f16, dqkv_f16 = _member(p.o_dtype) not in f8, _member(p.dqkv_dtype) not in f8
    if not (tensor or (mx and o_f16)) or (training and not (tensor or (mx and dqkv_f16))):
        return "fp8_recipe", "FP8 fused attention only supports delayed/current scaling or MXFP8"
    if mx and cudnn < (9, 21, 0):
        return "mxfp8_cudnn", "MXFP8 fused attention requires cuDNN 9.21.0"
    return None


# ------------------------------------------------------------------------------- the driver
@dataclass(frozen=True)
class TEAnswer:
    """TE's ``available_backends`` (flash, fused, unfused), its flash version and sub-backend,
    and which backend it selected; how often its Python reached the C++ query
    (``cpp_queries``, one per context-parallel step), the first C++ pre-graph refusal
    (``cpp_refusal``, a :func:`cpp_prechecks` key) and FusedAttention by TE's Python side alone
    (``fused_python``: the C++ query answering "supported")."""

    flash: bool
    fused: bool
    unfused: bool
    flash_version: str | None
    fused_sub_backend: int | None
    selected: str | None
    log: tuple[str, ...] = ()
    cpp_queries: int = 0
    cpp_refusal: str | None = None
    fused_python: bool = False

    @property
    def flash_flavour(self) -> str | None:
        """``fa2``/``fa3``/``fa4`` from the flash-attn version TE reports."""
        if not self.flash or self.flash_version is None:
            return None
        return f"fa{self.flash_version[0]}"


def _version_tuple(text: str | None) -> tuple[int, int, int]:
    if not text:
        return (0, 0, 0)
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


class TE:
    """TE's real selector, driven on CPU for a catalog :class:`DeviceProfile`."""

    def __init__(self, fa3_supports_softcap: bool = True, cpp_refusals: bool = True) -> None:
        """``fa3_supports_softcap``: what TE's signature probe of an installed FA3 finds (FA3
        builds from flash-attention/hopper have taken ``softcap`` since 2.7). ``cpp_refusals``:
        the C++ query refuses what TE's C++ refuses before building a graph
        (:func:`cpp_prechecks`); off, it answers "supported" to everything."""
        self.te = load()
        self.fa3_supports_softcap = fa3_supports_softcap
        self.cpp_refusals = cpp_refusals
        self.validator, self.validator_source = _fa4_validator()
        self.fused_queries = 0
        self._arch: tuple[int, tuple[int, int, int]] | None = None  # (sm, cuDNN) of device()
        self._answers: list[str | None] = []  # this decide()'s C++ answers (refusal keys)
        te = self.te
        fp8_dtypes = {int(te.tex.DType.kFloat8E4M3), int(te.tex.DType.kFloat8E5M2)}
        backend = te.fused.FusedAttnBackend

        def get_fused_attn_backend(params: Any) -> tuple[int, str]:
            """TE's C++ pre-graph refusals, else cuDNN accepts: the FP8 sub-backend for FP8
            q/k/v, F16_arbitrary_seqlen otherwise."""
            self.fused_queries += 1
            refused = None
            if self.cpp_refusals and self._arch is not None:
                refused = cpp_prechecks(params, *self._arch)
            self._answers.append(refused[0] if refused else None)
            if refused:
                return backend.No_Backend, refused[1]
            fp8 = int(params.qkv_dtype) in fp8_dtypes
            return (backend.FP8 if fp8 else backend.F16_arbitrary_seqlen), ""

        te.tex.get_fused_attn_backend = get_fused_attn_backend

    @contextlib.contextmanager
    def device(self, d: DeviceProfile) -> Iterator[None]:
        """Patch compute capability, cuDNN and the flash-attn installs to match ``d``."""
        from packaging.version import Version

        u = self.te.utils
        fa = u.FlashAttentionUtils
        names = [n for n in vars(fa) if not n.startswith("__") and not callable(getattr(fa, n))]
        names.append("v4_validate_head_dims")
        saved_attrs = {n: getattr(fa, n) for n in names}
        saved_funcs = (u.get_device_compute_capability, u.get_cudnn_version)
        assert d.sm is not None, "TE parity needs a GPU profile"
        cc = (d.sm // 10, d.sm % 10)
        cudnn = _version_tuple(d.cudnn)
        u.get_device_compute_capability = lambda: cc
        u.get_cudnn_version = lambda: cudnn
        saved_arch, self._arch = self._arch, (d.sm, cudnn)
        try:
            # backends.py: flash-attn 2 counts as installed inside [2.1.1 (2.7.3 on sm100+), 2.8.4)
            fa.is_installed = False
            fa.version = Version("0")
            fa.version_required = Version("2.1.1")
            if d.flash_attn:
                v = Version(d.flash_attn)
                fa.version = v
                lo = fa.version_required_blackwell if cc >= (10, 0) else fa.version_required
                if fa.is_version_supported(v, lo):
                    fa.set_flash_attention_version()
            fa.v3_is_installed = False
            fa.fa3_version = Version("0")
            fa.fa3_supports_softcap = False
            if d.flash_attn_3:
                fa.fa3_version = Version(Version(d.flash_attn_3).public)
                fa.set_flash_attention_3_params()
                fa.fa3_supports_softcap = self.fa3_supports_softcap
            fa.v4_is_installed = False
            fa.fa4_version = Version("0")
            fa.v4_validate_head_dims = None
            if d.flash_attn_4:
                fa.fa4_version = Version(d.flash_attn_4)
                fa.v4_validate_head_dims = self.validator
                fa.set_flash_attention_4_params()
            # The "please install flash-attn" hints call torch.cuda.current_device(): skip them.
            fa.warning_printed = fa.v3_warning_printed = fa.v4_warning_printed = True
            with _env(TE_ENV):
                yield
        finally:
            for n, v in saved_attrs.items():
                setattr(fa, n, v)
            u.get_device_compute_capability, u.get_cudnn_version = saved_funcs
            self._arch = saved_arch

    @contextlib.contextmanager
    def _captured_log(self, level: int) -> Iterator[list[str]]:
        """TE's log for one call (``level`` and up), kept out of the root logger and stderr."""
        lines: list[str] = []

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        u = self.te.utils
        logger = logging.getLogger("DotProductAttention")
        handler = Collect(level)
        saved = (u.AttentionLogging._log_level, logger.propagate, logger.level)
        u.AttentionLogging._log_level = level
        logger.propagate = False
        logger.addHandler(handler)
        try:
            yield lines
        finally:
            logger.removeHandler(handler)
            u.AttentionLogging._log_level, logger.propagate, _ = saved
            logger.setLevel(saved[2])

    def decide(self, c: FusedAttnConfig, d: DeviceProfile, log: bool = True) -> TEAnswer:
        """Run TE's ``get_attention_backend`` for ``c`` on ``d`` (with TE's debug log unless
        ``log`` is false: the log costs about half the time of a call)."""
        level = logging.DEBUG if log else logging.CRITICAL
        answers = self._answers = []
        with self.device(d), self._captured_log(level) as lines, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            params = attention_params(self.te, c)
            use_flash, flash_ver, use_fused, fused_be, use_unfused, avail = (
                self.te.utils.get_attention_backend(params)
            )
        selected = ("flash" if use_flash else "fused" if use_fused else
                    "unfused" if use_unfused else None)  # fmt: skip
        refusal = next((a for a in answers if a is not None), None)
        fused_python = bool(avail[1])
        if refusal is not None:  # what TE's Python side alone says: ask again, C++ accepting
            saved, self.cpp_refusals = self.cpp_refusals, False
            try:
                fused_python = self.decide(c, d, log=False).fused
            finally:
                self.cpp_refusals = saved
        return TEAnswer(
            flash=bool(avail[0]),
            fused=bool(avail[1]),
            unfused=bool(avail[2]),
            flash_version=str(flash_ver) if avail[0] and flash_ver is not None else None,
            fused_sub_backend=int(fused_be) if fused_be is not None else None,
            selected=selected,
            log=tuple(line for line in lines if not line.startswith("Running with config")),
            cpp_queries=len(answers),
            cpp_refusal=refusal,
            fused_python=fused_python,
        )


# ----------------------------------------------------------------------------- pytest fixture
try:
    import pytest
except ImportError:  # pragma: no cover - pytest is a test dependency
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def te_selector() -> TE:
        """TE's real ``get_attention_backend`` on CPU, imported once per session. Errors (never
        skips) when TE cannot be imported: TE is a test dependency."""
        return TE()
