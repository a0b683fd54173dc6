"""Ask cuDNN itself: build exactly the graphs TransformerEngine 2.20.2 builds, let cuDNN decide.

:func:`probe_config` maps one :class:`~te_fl_attention.config.FusedAttnConfig` (as its
``to_dict()``, so a worker process gets plain JSON) to the cudnn-frontend graphs TE 2.20.2's
FusedAttention builds for it: the forward one and, for training, the backward one, as its C++
builds them (``transformer_engine/common/fused_attn/``; read from its sources and checked against
the 2.20.2 binary, see the citations in each docstring below):

* :func:`derive` is TE's ``FusedAttnConfig::derive()``: the bottom-right-diagonal rewrite,
  ``uses_cu_seqlens_directly`` (runtime cuDNN >= 9.24 F16 / 9.25 FP8, no dropout), the ragged
  graph (thd on sm >= 90, sm != 120) with its bucketed batch (``get_max_batch_size``) and token
  counts (``get_max_tokens``), graph batch and sequence dims per pass, ragged offset types and
  multipliers, the bias tensor's real dims (ALiBi with custom slopes as the post-scale bias TE's
  Python turns it into), FP8 tensor types per recipe.
* :func:`te_refusal` is what ``nvte_get_fused_attn_backend_v2`` refuses before building any
  graph (code ``cudnn.te_refused``, step ``derive``; decided: TE never asks cuDNN then).
* :class:`_Builder` is ``create_graph_f16_fwd/bwd`` and ``create_graph_fp8_fwd/bwd``: tensor
  names, dims, strides (``generateMatrixStrides``), data types (left unset where TE leaves them),
  ragged offsets, cu_seq_len + UNIFIED or seq_len tensors, TH1 or BHS1 stats, diagonal
  alignment and bounds, dBias unless the bias is ``[1, 1, 1, s_kv]``, ``max_total_seq_len`` only
  in the F16 backward, Seed/Offset, sink tokens, max logit, paged KV, FP8 scales and amaxes.

Then it runs TE's support query (graph_cache.h ``query_support``)::

    validate -> build_operation_graph -> create_execution_plans(heur_mode.A) -> check_support
    (-> build_plans, off by default: it compiles kernels and takes ~0.3 s)

TE asks heur_mode.A only, so A's answer is the verdict; when A finds no supported plan,
heur_mode.FALLBACK is asked too, only for a note saying whether it would have offered one.
cuDNN's exception text is reported verbatim. With ``spec=True`` the result also carries
``graph_spec``: each built graph's cudnn-frontend JSON (``json.loads(str(graph))``, the same
JSON ``CUDNN_FRONTEND_LOG_INFO=1`` logs), taken after ``validate`` (or as far as it got when
building or validating failed), and ``derived`` (:class:`TEGraphConfig` as JSON).

The graphs are the cudnn-frontend C++ graph (``cudnn._pybind_module.backend_graph``), the one TE
drives through the C++ API: only cuDNN backend engines are considered. The frontend's
Python-native engines (``cudnn.pygraph``'s "FROST" engines) are left out on purpose, because TE
cannot dispatch to them. What the probe still cannot express (context parallelism, softcap,
score_mod, arbitrary masks, paged KV in training, the MXFP8 graph) is refused undecided
(``cudnn.unsupported_by_probe`` / ``cudnn.fp8_unsupported_by_probe``).

Without a GPU this needs cuDNN >= 9.11 "deviceless" mode: a device descriptor
(:mod:`te_fl_attention.descriptors`) plus ``sm_version``, and a loadable ``libcuda.so.1``, which
:mod:`._stubcuda` provides. cuDNN can abort the process on bad input, so call this from the
probe worker (:mod:`.cudnn_worker`), not from a process you care about.

With ``use_real_gpu`` and a real driver with a GPU loaded, the graphs are built on a real cuDNN
handle of the current device instead (``backend_graph(handle=<raw cudnnHandle_t>)``, mode
``"device"``; the descriptor is then only a fallback when the handle cannot be created). Where
no real driver is loaded the descriptor answers, deviceless, and ``notes`` says so. The
real-handle path **never ran on a GPU**; the test suite runs it with a fake handle
(``tests/fakegpu``) over the real deviceless planner.

The result is a JSON-able dict::

    {"supported": bool,          # cuDNN accepted every graph (fwd, and bwd when training)
     "decided": bool,            # cuDNN (or TE's C++ before it) answered; False: not asked
     "code": str | None,         # None, "cudnn.not_supported", "cudnn.te_refused",
                                 # "cudnn.unavailable", "cudnn.unsupported_by_probe",
                                 # "cudnn.fp8_unsupported_by_probe", "cudnn.bad_descriptor",
                                 # "cudnn.probe_error"
     "step": str | None,         # the failed step: build_graph, validate, build_operation_graph,
                                 # create_execution_plans, check_support, build_plans; TE's
                                 # derive (its own refusal); or the probe's own: backend,
                                 # device, mapping
     "graph": "fwd" | "bwd" | None,
     "message": str | None,      # cuDNN's exception text, verbatim
     "summary": str | None,      # its first line plus the specific "Reason:" lines, deduplicated
     "error_type": str | None,
     "cudnn_version": "9.28.1", "frontend_version": "1.32.0",
     "mode": "deviceless" | "device", "driver": "stub" | "real" | "real-nodevice" | ...,
     "sm": 90, "device": "NVIDIA H100 80GB HBM3",
     "plans": {"fwd": [names...], "bwd": [names...]},   # heur_mode.A's plans
     "heur_mode": {"fwd": "A", "bwd": "A"},   # the mode that gave the verdict
     "notes": [str, ...],        # what the mapping assumed or left out
     "elapsed_ms": float,
     # with spec=True only:
     "graph_spec": {"fwd": {...}, "bwd": {...}},   # cudnn-frontend JSON of each graph built
     "derived": {...}}                             # TE's derived config (TEGraphConfig)
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import FusedAttnConfig, layout_group, ragged_pieces, te_max_batch_size

#: The pipeline, in order (``build_plans`` only when asked).
PIPELINE = ("validate", "build_operation_graph", "create_execution_plans", "check_support")

#: Heuristic modes: the first gives the verdict (TE 2.20.2 asks heur_mode.A only, graph_cache.h
#: ``query_support``); the others are asked only for a note when it finds no supported plan.
HEURISTICS = ("A", "FALLBACK")

#: Oldest cuDNN with deviceless planning (device descriptor + sm_version).
MIN_DEVICELESS_CUDNN = 91100

#: FP8 recipes the probe can express with ``sdpa_fp8`` (per-tensor scales).
FP8_PROBED_RECIPES = ("delayed", "current")

_GENERIC_REASON_MARKERS = (
    "isSupported()",
    "finalize_internal()",
    "(CUDNN_STATUS_NOT_INITIALIZED == status)",
    "process_knob_choices()",
    "resolveSDPAKernelConfig(",
)

_lock = threading.RLock()
_backend: dict[str, Any] | None = None
_device_props: dict[str, Any] = {}
_handles: dict[int, Any] = {}


# ---------------------------------------------------------------------------------------- results
def _result(**kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "supported": False,
        "decided": False,
        "code": None,
        "step": None,
        "graph": None,
        "message": None,
        "summary": None,
        "error_type": None,
        "cudnn_version": None,
        "frontend_version": None,
        "mode": None,
        "driver": None,
        "sm": None,
        "device": None,
        "plans": {},
        "heur_mode": {},
        "notes": [],
        "elapsed_ms": 0.0,
    }
    out.update(kw)
    return out


def summarize(message: str | None, limit: int = 600) -> str | None:
    """cuDNN's message, shortened: its first line plus, for each engine it lists, the first
    ``Reason:`` (the specific one; the rest of each chain is call-stack frames), deduplicated.

    A "No valid engine configs" text names every engine config it tried, each followed by its
    refusal chain (``Warning: <status>; Reason: <why>``, then generic wrappers).
    """
    if not message:
        return message
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    head = lines[0].rstrip("_ ").strip()
    reasons: list[str] = []
    in_block = take = False
    for ln in lines[1:]:
        if ln.startswith("{"):
            in_block = take = True
            continue
        if "Reason:" not in ln or (in_block and not take):
            continue
        reason = ln.split("Reason:", 1)[1].strip()
        take = False
        if any(m in reason for m in _GENERIC_REASON_MARKERS):
            continue
        if reason not in reasons:
            reasons.append(reason)
    text = head if not reasons else f"{head}: " + " | ".join(reasons)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------- backend
def _wheel_lib_dirs() -> list[str]:
    roots = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    return sorted(roots)


def _cublas_problem() -> str | None:
    """cuDNN aborts the process (SIGABRT) when libcublasLt cannot be loaded; say so first.

    Only checked when libcudnn comes from the nvidia-cudnn wheel, whose RUNPATH names the
    sibling cublas / cu13 / cu12 wheel directories.
    """
    for root in _wheel_lib_dirs():
        cudnn_libs = glob.glob(os.path.join(root, "nvidia", "cudnn", "lib", "libcudnn.so.*"))
        if not cudnn_libs:
            continue
        for sub in ("cublas", "cu13", "cu12"):
            if glob.glob(os.path.join(root, "nvidia", sub, "lib", "libcublasLt.so.*")):
                return None
        for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
            if d and glob.glob(os.path.join(d, "libcublasLt.so.*")):
                return None
        return (
            "cuBLAS (libcublasLt) is not installed next to the nvidia-cudnn wheel; cuDNN would "
            "abort the process while planning: pip install nvidia-cublas"
        )
    return None


def backend_status() -> dict[str, Any]:
    """Set up the driver (stub if needed), import cudnn and check versions; cached per process.

    Returns ``{"ok": bool, "error": str | None, "driver": mode, "cudnn_version": ...,
    "frontend_version": ..., "version_int": int}``.
    """
    global _backend
    with _lock:
        if _backend is not None:
            return _backend
        _backend = _init_backend()
        return _backend


def _init_backend() -> dict[str, Any]:
    from . import _stubcuda

    st: dict[str, Any] = {
        "ok": False,
        "error": None,
        "driver": None,
        "cudnn_version": None,
        "frontend_version": None,
        "version_int": 0,
    }
    if importlib.util.find_spec("cudnn") is None:
        st["error"] = (
            "cudnn-frontend is not installed (pip install nvidia-cudnn-frontend nvidia-cudnn-cu13 "
            "nvidia-cublas, or the te-fl-attention[cudnn] extra)"
        )
        return st
    problem = _cublas_problem()
    if problem:
        st["error"] = problem
        return st
    setup = _stubcuda.setup_driver()
    st["driver"] = setup.mode
    if not setup.ok:
        st["error"] = f"no NVIDIA driver and no stub driver: {setup.error}"
        return st
    try:
        import cudnn
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
        st["error"] = f"import cudnn failed: {type(exc).__name__}: {exc}"
        return st
    st["frontend_version"] = getattr(cudnn, "__version__", None)
    try:
        st["version_int"] = int(cudnn.backend_version())
        st["cudnn_version"] = cudnn.backend_version_string()
    except Exception as exc:  # noqa: BLE001
        st["error"] = (
            f"the cuDNN library (libcudnn.so.9) was not found: {exc}; "
            "pip install nvidia-cudnn-cu13 (or -cu12)"
        )
        return st
    if setup.mode != "real" and st["version_int"] < MIN_DEVICELESS_CUDNN:
        st["error"] = (
            f"cuDNN {st['cudnn_version']} cannot plan without a GPU: deviceless mode needs "
            "cuDNN >= 9.11"
        )
        return st
    if not hasattr(getattr(cudnn, "_pybind_module", None), "backend_graph"):
        st["error"] = (
            f"cudnn-frontend {st['frontend_version']} has no cudnn._pybind_module.backend_graph "
            "(the C++ graph TE uses); the probe supports cudnn-frontend 1.2x-1.3x"
        )
        return st
    st["ok"] = True
    return st


def _device_properties(cudnn: Any, desc_json: str) -> Any:
    with _lock:
        dp = _device_props.get(desc_json)
        if dp is None:
            dp = cudnn.create_device_properties(desc_json)
            _device_props[desc_json] = dp
        return dp


def _real_handle(cudnn: Any) -> Any:  # gpu-only
    """A cuDNN handle on this process's current CUDA device (one per device, kept for the
    process). ``cudnn.create_handle()`` binds it to the current device; the probe worker is
    narrowed to its parent's device, where that is device 0. Never ran on a GPU."""
    from ..descriptors import current_ordinal

    ordinal = current_ordinal()
    with _lock:
        handle = _handles.get(ordinal)
        if handle is None:
            handle = _handles[ordinal] = cudnn.create_handle()
        return handle


def backend_handle(handle: Any) -> Any:
    """The raw ``cudnnHandle_t`` (an int) that ``backend_graph(handle=...)`` takes: cudnn-frontend
    >= 1.32's ``create_handle()`` returns a ``cudnn.Handle``, unwrapped by its
    ``to_backend_handle``; older frontends hand out the int itself."""
    try:
        from cudnn._handle import to_backend_handle
    except ImportError:
        return handle
    return to_backend_handle(handle)


def _real_device(sm: int | None) -> tuple[int, str | None]:  # gpu-only
    """The sm and name of the device a real handle plans on, read from it when the caller
    sent no descriptor (the worker's device 0, or the current device in-process). Never ran on
    a GPU."""
    from ..descriptors import capture_device_descriptor, current_ordinal, descriptor_sm

    desc = capture_device_descriptor(current_ordinal())
    return (descriptor_sm(desc) if sm is None else sm), desc["deviceName"]


# ---------------------------------------------------------------------------------------- layouts
def layout_pieces(qkv_layout: str) -> tuple[str, str, str]:
    """The memory format of q, k and v in a TE layout string: ``"bshd_bs2hd"`` ->
    ``("bshd", "bs2hd", "bs2hd")``; ``"sb3hd"`` -> three times ``"sb3hd"``; ``t`` stays."""
    parts = qkv_layout.replace("paged_kv_", "").split("_")
    if len(parts) == 1:
        return parts[0], parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1], parts[1]
    return parts[0], parts[1], parts[2]


def strides_bhsd(fmt: str, sizes: Mapping[str, int], pack: int | None = None) -> list[int]:
    """Strides, in ``[b, h, s, d]`` order, of a tensor stored as ``fmt``.

    ``fmt`` lists the memory dims outermost first: ``b``, ``s``, ``h``, ``d``; ``t`` means
    ``b`` then ``s`` (packed tokens, addressed through ragged offsets); a digit is a packing dim
    holding q/k/v (``3``) or k/v (``2``). ``sizes`` gives ``b, s, h, d`` for this tensor.
    """
    dims: list[tuple[str, int]] = []
    for ch in fmt.replace("t", "bs"):
        if ch.isdigit():
            dims.append(("pack", int(ch) if pack is None else pack))
        else:
            dims.append((ch, int(sizes[ch])))
    stride: dict[str, int] = {}
    acc = 1
    for name, size in reversed(dims):
        stride[name] = acc
        acc *= size
    return [stride["b"], stride["h"], stride["s"], stride["d"]]


def _plain(fmt: str) -> str:
    return "".join(c for c in fmt if not c.isdigit())


# ---------------------------------------------------------------------------------------- mapping
# Everything below mirrors TE 2.20.2's C++ (transformer_engine/common/fused_attn/), as read from
# its sources and checked against the 2.20.2 binary (/work/notes/te_cpp_fused_attn.md). Files:
# config_and_params.cpp (FusedAttnConfig::derive), fused_attn.cpp (nvte_get_fused_attn_backend_v2),
# fused_attn_f16_arbitrary_seqlen.cu (create_graph_f16_fwd/bwd), fused_attn_fp8.cu
# (create_graph_fp8_fwd/bwd), utils.cu / utils.h (strides, buckets, offset multipliers),
# graph_cache.h (query_support). TE's code is paraphrased, never copied.
class _Unsupported(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _check_expressible(c: FusedAttnConfig) -> None:
    """Features the probe cannot put into TE's cuDNN graphs: refuse honestly, undecided."""
    u = "cudnn.unsupported_by_probe"
    if c.softcap:
        raise _Unsupported(u, f"softcap={c.softcap}: cuDNN's SDPA node has no softcap attribute")
    if c.has_score_mod or c.has_score_mod_bprop:
        raise _Unsupported(u, "score_mod callbacks are not mapped by the probe")
    if c.context_parallel:
        raise _Unsupported(
            u,
            f"context parallelism ({c.cp_comm_type}, cp_size={c.cp_size}): the per-rank chunk "
            "graphs are not built by the probe",
        )
    if c.paged and c.is_training:
        raise _Unsupported(u, "a paged KV cache in training: TE builds no paged backward graph")
    if c.attn_mask_type == "arbitrary":
        raise _Unsupported(u, "attn_mask_type=arbitrary: no cuDNN SDPA mask attribute for it")


def _check_fp8_expressible(c: FusedAttnConfig) -> None:
    """FP8 recipes whose TE graph the probe does not build (after TE's own refusals)."""
    if c.fp8 and c.fp8_recipe not in FP8_PROBED_RECIPES:
        raise _Unsupported(
            "cudnn.fp8_unsupported_by_probe",
            f"fp8_recipe={c.fp8_recipe}: the probe builds FP8 graphs only for per-tensor scaling "
            f"({', '.join(FP8_PROBED_RECIPES)}) with sdpa_fp8; TE's MXFP8 graph (FP8_E8M0 "
            "block descales, Q_t/K_t/dO_t) is not mapped",
        )


#: Offset-multiplier role -> the field TE's ``RaggedOffsetMultipliers`` keeps for it.
_MULT_ROLES = ("q", "k", "v", "o", "stats")


@dataclass(frozen=True)
class TEGraphConfig:
    """What TE 2.20.2's ``FusedAttnConfig::derive()`` (config_and_params.cpp; binary
    0x1c63880) computes from one config, i.e. everything its graph builders read.

    ``layout``: the layout the builders see (FP8 per-tensor scaling drops ``paged_kv_``:
    Python ``get_fused_attn_spec``). ``ragged_q``/``ragged_kv``: q / kv format is THD.
    ``padding``: a padding mask. ``bias``: POST_SCALE_BIAS reaches the C++ (also ALiBi with
    custom slopes, which TE's Python rewrites). ``alibi``: NVTE_ALIBI (standard slopes only).
    ``dropout``: the probability when ``is_training`` and non-zero, else 0.
    ``bottom_right_diagonal``: after derive's rewrite. ``uses_cu_seqlens_directly``: cuDNN >=
    9.24 (F16/BF16) / 9.25 (FP8) and no dropout. ``uses_ragged_graph``: sm >= 90 and sm != 120
    (2.20.2 binary). ``uses_ragged_stats``: ragged q on the ragged graph (TH1 stats).
    ``graph_batch_size_fwd/bwd``, ``graph_max_seqlen_q/kv``: the dims the graphs are built with.
    ``ragged_offset_type_fwd/bwd``: INT32 with ``uses_cu_seqlens_directly`` in the forward,
    INT64 otherwise (the backward always). ``offset_mults``: ``RaggedOffsetMultipliers``
    (utils.h). ``bias_dims``: the bias tensor's real ``(b, h, s_q, s_kv)``.
    """

    layout: str
    sm: int
    cudnn_version: int
    fp8: bool
    ragged_q: bool
    ragged_kv: bool
    paged: bool
    padding: bool
    causal: bool
    causal_bottom_right: bool
    bias: bool
    alibi: bool
    softmax_offset: bool
    dropout: float
    deterministic: bool
    return_max_logit: bool
    bottom_right_diagonal: bool
    window: tuple[int, int]
    uses_cu_seqlens_directly: bool
    uses_ragged_graph: bool
    uses_ragged_stats: bool
    batch_size: int
    bucketed_batch_size: int
    num_tokens_q: int | None
    num_tokens_kv: int | None
    graph_batch_size_fwd: int
    graph_batch_size_bwd: int
    graph_max_seqlen_q: int
    graph_max_seqlen_kv: int
    ragged_offset_type_fwd: str
    ragged_offset_type_bwd: str
    offset_mults: dict[str, int]
    kv_offsets_from_q: bool
    bias_dims: tuple[int, int, int, int] | None
    num_pages: int
    page_size: int
    max_pages_per_seq: int
    h: int
    hg: int
    d_qk: int
    d_v: int
    qkv_dtype: str
    o_dtype: str
    do_dtype: str
    dqkv_dtype: str
    fp8_delayed: bool
    fp8_current: bool
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (tuples become lists)."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out


def _bias_dims(c: FusedAttnConfig) -> tuple[int, int, int, int] | None:
    """The bias tensor's dims as TE's C++ receives them (``bias_batch_size, bias_num_heads,
    bias_seqlen_q, bias_seqlen_kv`` = the real tensor's shape; Python
    ``get_attention_backend``, dot_product_attention/utils.py). ALiBi with custom slopes is
    rewritten there to post_scale_bias ``(1, h, s_q, s_kv)`` for ``[h]`` slopes and ``(b, h,
    s_q, s_kv)`` for ``[b, h]`` slopes (no grad)."""
    b, h, sq, skv = c.batch_size, c.num_heads, c.max_seqlen_q, c.max_seqlen_kv
    assert skv is not None
    if c.bias_type == "alibi":
        if c.alibi_slopes_shape is None:
            return None
        return (1, h, sq, skv) if len(c.alibi_slopes_shape) == 1 else (b, h, sq, skv)
    if c.bias_type != "post_scale_bias" or c.bias_shape is None:
        return None
    code = c.bias_shape
    return (
        b if code[0] == "b" else 1,
        h if code[1] == "h" else 1,
        1 if code == "111s" else sq,
        skv,
    )


def _fp8_dtypes(c: FusedAttnConfig) -> tuple[str, str, str, str]:
    """``(qkv, o, dO, dQKV)`` dtypes of an FP8 graph: Python ``get_fused_attn_spec``
    (dot_product_attention/utils.py). Delayed: O in the forward FP8 type, dO/dQKV in the
    gradient FP8 type; current scaling: O (``NVTE_DPA_FP8CS_O_in_F16=1``, the default) and dQKV
    in the model dtype, dO in the gradient FP8 type. The recipe's ``fp8_format`` is not in the
    config: its default (``Format.HYBRID``: E4M3 forward, E5M2 gradients) is assumed."""
    qkv = "fp8_e5m2" if c.dtype == "fp8_e5m2" else "fp8_e4m3"
    model = c.dtype if c.dtype in ("fp16", "bf16") else "bf16"
    grad = "fp8_e5m2"
    if c.fp8_recipe == "current":
        return qkv, model, grad, model
    return qkv, qkv, grad, grad


def derive(c: FusedAttnConfig, sm: int, cudnn_version: int) -> TEGraphConfig:
    """TE 2.20.2's ``FusedAttnConfig::derive()`` (config_and_params.cpp) for ``c`` on ``sm``
    with the runtime cuDNN ``cudnn_version`` (``cudnnGetVersion()``, e.g. 92801)."""
    notes: list[str] = []
    fp8 = c.fp8
    layout = c.qkv_layout
    if c.paged and not layout.startswith("paged_kv_"):
        layout = "paged_kv_" + layout  # TE names a paged cache's layout paged_kv_*
    if fp8 and c.fp8_recipe in FP8_PROBED_RECIPES:
        layout = layout.replace("paged_kv_", "")  # get_fused_attn_spec: per-tensor scaling
    ragged_q, ragged_kv = ragged_pieces(layout)
    paged = layout.startswith("paged_kv_")
    m = c.attn_mask_type
    causal = m in ("causal", "padding_causal")
    causal_br = m in ("causal_bottom_right", "padding_causal_bottom_right")
    window = tuple(c.window_size)  # type: ignore[arg-type]
    # derive(): bottom-right masks force BOTTOM_RIGHT, top-left causal masks TOP_LEFT, and any
    # other mask without a window TOP_LEFT (2.20.2 binary 0x1c63cc0-0x1c63d2a).
    if causal_br:
        brd = True
    elif causal or window == (-1, -1):
        brd = False
    else:
        brd = bool(c.bottom_right_diagonal)
    dropout = c.dropout if c.is_training and c.dropout else 0.0
    # derive(): cu_seqlens go to cuDNN directly with runtime cuDNN >= 9.24 (F16) / 9.25 (FP8)
    # and no dropout, for every padding mask (2.20.2 binary 0x1c63a03-0x1c63a2d).
    uses_cu = cudnn_version >= (92500 if fp8 else 92400) and not dropout
    uses_ragged_graph = sm >= 90 and sm != 120
    ragged = ragged_q or ragged_kv
    b = c.batch_size
    bucketed_b = te_max_batch_size(b) if ragged else b
    if ragged and uses_ragged_graph:
        gb_bwd = bucketed_b
        gb_fwd = b if uses_cu else bucketed_b
    else:
        gb_fwd = gb_bwd = b
    assert c.max_seqlen_kv is not None
    sq = c.num_tokens_q if ragged_q and uses_ragged_graph else c.max_seqlen_q
    skv = c.num_tokens_kv if ragged_kv and uses_ragged_graph else c.max_seqlen_kv
    assert sq is not None and skv is not None
    h, hg = c.num_heads, c.num_gqa_groups
    dqk, dv = c.head_dim_qk, c.head_dim_v
    assert hg is not None and dv is not None
    # RaggedOffsetMultipliers (utils.h): per-token element counts of each tensor.
    group = layout_group(layout)
    mults = {"q": h * dqk, "k": hg * dqk, "v": hg * dv, "o": h * dv, "stats": h}
    kv_from_q = group in ("3hd", "h3d")
    if kv_from_q:
        mults["q"] = mults["k"] = mults["v"] = 3 * h * dqk
    elif group in ("hd_2hd", "hd_h2d"):
        mults["k"] = mults["v"] = 2 * hg * dqk
    num_pages = page_size = mpps = 0
    if paged:
        page_size = c.page_size
        mpps = -(-c.max_seqlen_kv // page_size)
        num_pages = b * mpps
        notes.append(
            f"paged KV: num_pages={num_pages} (batch * ceil(s_kv / page_size)) and "
            f"max_pages_per_seq={mpps} assumed; TE takes both from its KV cache manager"
        )
    if fp8:
        qkv_t, o_t, do_t, dqkv_t = _fp8_dtypes(c)
        if c.is_training:
            notes.append(
                "FP8: dO and dQKV types follow the recipe's default fp8_format (HYBRID: E5M2 "
                "gradients); the config does not carry fp8_format"
            )
    else:
        qkv_t = o_t = do_t = dqkv_t = c.dtype
    if c.num_splits > 1:
        notes.append(f"num_splits={c.num_splits} ignored (no cuDNN graph attribute)")
    return TEGraphConfig(
        layout=layout,
        sm=sm,
        cudnn_version=cudnn_version,
        fp8=fp8,
        ragged_q=ragged_q,
        ragged_kv=ragged_kv,
        paged=paged,
        padding="padding" in m,
        causal=causal,
        causal_bottom_right=causal_br,
        bias=_bias_dims(c) is not None,
        alibi=c.bias_type == "alibi" and c.alibi_slopes_shape is None,
        softmax_offset=c.softmax_type != "vanilla",
        dropout=dropout,
        deterministic=c.deterministic,
        return_max_logit=c.return_max_logit,
        bottom_right_diagonal=brd,
        window=(int(window[0]), int(window[1])),
        uses_cu_seqlens_directly=uses_cu,
        uses_ragged_graph=uses_ragged_graph,
        uses_ragged_stats=ragged_q and uses_ragged_graph,
        batch_size=b,
        bucketed_batch_size=bucketed_b,
        num_tokens_q=c.num_tokens_q,
        num_tokens_kv=c.num_tokens_kv,
        graph_batch_size_fwd=gb_fwd,
        graph_batch_size_bwd=gb_bwd,
        graph_max_seqlen_q=sq,
        graph_max_seqlen_kv=skv,
        ragged_offset_type_fwd="INT32" if uses_cu else "INT64",
        ragged_offset_type_bwd="INT64",
        offset_mults=mults,
        kv_offsets_from_q=kv_from_q,
        bias_dims=_bias_dims(c),
        num_pages=num_pages,
        page_size=page_size,
        max_pages_per_seq=mpps,
        h=h,
        hg=hg,
        d_qk=dqk,
        d_v=dv,
        qkv_dtype=qkv_t,
        o_dtype=o_t,
        do_dtype=do_t,
        dqkv_dtype=dqkv_t,
        fp8_delayed=fp8 and c.fp8_recipe == "delayed",
        fp8_current=fp8 and c.fp8_recipe == "current",
        notes=tuple(notes),
    )


def _te_qkv_format(layout: str) -> str:
    """``nvte_get_qkv_format``: one format when q and kv agree, else e.g. ``thd_2bshd``."""
    q, k, _ = layout_pieces(layout)
    q, k = _plain(q), _plain(k)
    return q if q == k else f"{q}_2{k}"


def te_refusal(c: FusedAttnConfig, d: TEGraphConfig) -> str | None:
    """What TE 2.20.2's ``nvte_get_fused_attn_backend_v2`` (fused_attn.cpp) refuses before it
    builds any graph, the first hit in TE's order; ``None`` when it goes on to ask cuDNN. Stated
    once, as the binding rules :data:`te_fl_attention.probes.cudnn.CPP_RULES` (evaluated here for
    the device being planned), plus the C++'s own dtype check ("Unsupported QKV dtype"; TE's
    Python filter ``fused.dtype`` refuses such configs first)."""
    from ..device import DeviceProfile
    from .base import evaluate
    from .cudnn import CPP_RULES

    if not d.fp8 and c.dtype not in ("fp16", "bf16"):
        return f"Unsupported QKV dtype qkv_dtype={c.dtype} ."
    v = d.cudnn_version
    device = DeviceProfile("planned", sm=d.sm, cudnn=f"{v // 10000}.{v // 100 % 100}.{v % 100}",
                           source="catalog")  # fmt: skip
    reasons = evaluate(CPP_RULES, c, device)
    return f"{reasons[0].code}: {reasons[0].message}" if reasons else None


def te_matrix_strides(layout: str, matrix: str, b: int, h: int, s_q: int, s_kv: int, d: int
                      ) -> list[int]:  # fmt: skip
    """``[b, h, s, d]`` strides of the ``matrix`` ("Q", "K", "V", "O") of a layout: TE 2.20.2
    utils.cu ``generateMatrixStrides`` (and utils.h ``generateMatrixStridesWithLayout`` /
    ``WithFormat`` for FP8, which agree). BSHD/THD: b = s*h*d, h = d, s = h*d (s: the graph's
    seq dim, the bucketed token count for THD on the ragged graph); SBHD: b = h*d, s = b*h*d;
    packed 3/2 multiply by 3/2 (H3D/H2D: h = 3d/2d); BHSD: b = h*s*d, h = s*d, s = d. O uses
    the q format unpacked; q/k/v-packed (3) layouts take s_q for every matrix."""
    qf, kf, vf = layout_pieces(layout)
    if matrix in ("Q", "O"):
        fmt, s = (qf if matrix == "Q" else _plain(qf)), s_q
    else:
        fmt = kf if matrix == "K" else vf
        s = s_q if "3" in fmt else s_kv
    return strides_bhsd(fmt, {"b": b, "s": s, "h": h, "d": d})


def _dtype(cudnn: Any, name: str) -> Any:
    dt = cudnn.data_type
    return {
        "fp16": dt.HALF,
        "bf16": dt.BFLOAT16,
        "fp32": dt.FLOAT,
        "fp8_e4m3": dt.FP8_E4M3,
        "fp8_e5m2": dt.FP8_E5M2,
        "INT32": dt.INT32,
        "INT64": dt.INT64,
    }[name]


def _io_dtype(cudnn: Any, d: TEGraphConfig) -> Any:
    """The graph's io type: TE sets ``set_io_data_type(qkv dtype)`` in every builder."""
    return _dtype(cudnn, d.qkv_dtype)


class _Builder:
    """Builds TE 2.20.2's forward or backward graph of one derived config on one backend graph.

    Tensors TE creates without a data type are created without one here (cudnn-frontend fills
    in the graph's io type), so the graph's JSON matches TE's; the creation order follows TE's
    builders (it decides the UIDs cudnn-frontend hands out)."""

    def __init__(self, cudnn: Any, g: Any, d: TEGraphConfig) -> None:
        self.cudnn, self.g, self.d = cudnn, g, d
        self.dt = cudnn.data_type

    # -------------------------------------------------------------- helpers
    def t(self, name: str, dim: list[int], stride: list[int], dtype: Any = None, **kw: Any) -> Any:
        """``mha_graph->tensor(...)``; ``dtype=None``: TE sets no data type."""
        return self.g.tensor(
            name=name,
            dim=dim,
            stride=stride,
            data_type=self.dt.NOT_SET if dtype is None else dtype,
            **kw,
        )

    def scalar(self, name: str, dtype: Any = None, by_value: bool = False) -> Any:
        return self.t(
            name,
            [1, 1, 1, 1],
            [1, 1, 1, 1],
            self.dt.FLOAT if dtype is None else dtype,
            is_pass_by_value=by_value,
        )

    def one(self) -> Any:
        """TE's ``mha_graph->tensor(1.0f)``: a pass-by-value FLOAT 1.0 of dim/stride ``{1}``."""
        return self.g.tensor_scalar(1.0, self.cudnn.scalar_type.RUNTIME_PARAM)

    def offset(self, name: str, b: int, dtype: str) -> Any:
        """A ragged offset tensor ``[b+1, 1, 1, 1]`` stride 1 (every TE builder)."""
        return self.t(name, [b + 1, 1, 1, 1], [1, 1, 1, 1], _dtype(self.cudnn, dtype))

    def attach(self, tensor: Any, off: Any, role: str, with_mult: bool) -> None:
        """``set_ragged_offset`` (+ ``set_ragged_offset_multiplier`` when TE passes cu_seqlens
        directly, forward only)."""
        tensor.set_ragged_offset(off)
        if with_mult:
            tensor.set_ragged_offset_multiplier(self.d.offset_mults[role])

    def strides(self, matrix: str, b: int, h: int, d: int) -> list[int]:
        x = self.d
        return te_matrix_strides(
            x.layout, matrix, b, h, x.graph_max_seqlen_q, x.graph_max_seqlen_kv, d
        )

    def stats_stride(self, b: int) -> list[int]:
        """TH1 ``{h*s_q, 1, h, 1}`` on the ragged path (uses_ragged_stats), else BHS1
        ``{h*s_q, s_q, 1, 1}`` (create_graph_f16_fwd/bwd, create_graph_fp8_fwd/bwd)."""
        h, sq = self.d.h, self.d.graph_max_seqlen_q
        return [h * sq, 1, h, 1] if self.d.uses_ragged_stats else [h * sq, sq, 1, 1]

    def masking(self, kw: dict[str, Any], fp8: bool) -> None:
        """Diagonal alignment and band bounds. F16 (create_graph_f16_fwd/bwd, no version gate in
        2.20.2): BOTTOM_RIGHT iff bottom_right_diagonal; left = window_left + 1 unless -1;
        right = window_right unless -1; right 0 for both causal kinds. FP8
        (create_graph_fp8_fwd/bwd): ``set_causal_mask(is_causal)``, the bounds only with cuDNN
        >= 9.21, right 0 for bottom-right causal. cudnn-frontend's ``set_causal_mask(true)`` is
        TOP_LEFT + right bound 0 (graph_properties.h); its Python binding refuses
        ``use_causal_mask`` together with a right bound, so that effect is passed instead."""
        x = self.d
        left, right = x.window
        kw["diagonal_alignment"] = getattr(
            self.cudnn.diagonal_alignment, "BOTTOM_RIGHT" if x.bottom_right_diagonal else "TOP_LEFT"
        )
        lk, rk = ("left_bound", "right_bound") if fp8 else (
            "diagonal_band_left_bound", "diagonal_band_right_bound")  # fmt: skip
        if not fp8 or x.cudnn_version >= 92100:
            if left != -1:
                kw[lk] = left + 1
            if right != -1:
                kw[rk] = right
        if x.causal_bottom_right or x.causal:
            kw[rk] = 0

    def padding(self, kw: dict[str, Any], b: int, fwd: bool) -> None:
        """Padding: forward with cu_seqlens directly -> ``cu_seq_len_q/kv`` ``[b+1]`` INT32 and
        ``implementation(UNIFIED)``; otherwise (and always in the backward) ``seq_q/seq_kv``
        ``[b]`` INT32 (create_graph_f16_fwd/bwd, create_graph_fp8_fwd/bwd)."""
        if not self.d.padding:
            return
        kw["use_padding_mask"] = True
        i32 = self.dt.INT32
        if fwd and self.d.uses_cu_seqlens_directly:
            kw["cu_seq_len_q"] = self.t("cu_seq_len_q", [b + 1, 1, 1, 1], [1, 1, 1, 1], i32)
            kw["cu_seq_len_kv"] = self.t("cu_seq_len_kv", [b + 1, 1, 1, 1], [1, 1, 1, 1], i32)
            kw["implementation"] = self.cudnn.attention_implementation.UNIFIED
        else:
            kw["seq_len_q"] = self.t("seq_q", [b, 1, 1, 1], [1, 1, 1, 1], i32)
            kw["seq_len_kv"] = self.t("seq_kv", [b, 1, 1, 1], [1, 1, 1, 1], i32)

    def dropout(self, kw: dict[str, Any]) -> None:
        """``Seed`` / ``Offset``: INT64 ``[1,1,1,1]`` device tensors (every builder)."""
        if self.d.dropout:
            seed = self.scalar("Seed", self.dt.INT64)
            offset = self.scalar("Offset", self.dt.INT64)
            kw["dropout"] = (self.d.dropout, seed, offset)

    def sink(self, kw: dict[str, Any], bwd: bool) -> None:
        """Off-by-one / learnable softmax: ``softmax_offset`` ``[1,h,1,1]`` FLOAT as the sink
        token; the backward also ``d_softmax_offset`` (``set_dsink_token``)."""
        if not self.d.softmax_offset:
            return
        h = self.d.h
        kw["sink_token"] = self.t("softmax_offset", [1, h, 1, 1], [h, 1, 1, 1], self.dt.FLOAT)
        if bwd:
            kw["dSink_token"] = self.t(
                "d_softmax_offset", [1, h, 1, 1], [h, 1, 1, 1], self.dt.FLOAT
            )

    def bias(self, kw: dict[str, Any], bwd: bool) -> None:
        """Post-scale bias with its real dims, strides ``[h*sq*skv, sq*skv, skv, 1]``; in the
        backward dBias with the same dims unless the bias is ``[1, 1, 1, s_kv]`` whether or not
        it needs a gradient (create_graph_f16_bwd; TE's torch extension always allocates dBias,
        csrc/extensions/attention.cpp)."""
        dims = self.d.bias_dims
        if dims is None:
            return
        bb, bh, bsq, bskv = dims
        stride = [bh * bsq * bskv, bsq * bskv, bskv, 1]
        kw["bias"] = self.t("bias", list(dims), stride)
        if bwd and not (bb == 1 and bh == 1 and bsq == 1):
            kw["dBias"] = self.t("dBias", list(dims), stride)

    # -------------------------------------------------------------- F16/BF16
    def f16_forward(self) -> None:
        """``create_graph_f16_fwd`` (fused_attn_f16_arbitrary_seqlen.cu)."""
        x, dt = self.d, self.dt
        b, h, hg, dqk, dv = x.graph_batch_size_fwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        odt, mult = x.ragged_offset_type_fwd, x.uses_cu_seqlens_directly
        q = self.t("Q", [b, h, sq, dqk], self.strides("Q", b, h, dqk))
        if x.ragged_q:
            self.attach(q, self.offset("offset_q", b, odt), "q", mult)
        if x.paged:
            npg, ps = x.num_pages, x.page_size
            k_stride = te_matrix_strides(x.layout, "K", npg, hg, ps, ps, dqk)
            v_stride = te_matrix_strides(x.layout, "V", npg, hg, ps, ps, dv)
            k = self.t("K", [npg, hg, ps, dqk], k_stride)
            v = self.t("V", [npg, hg, ps, dv], v_stride)
        else:
            k = self.t("K", [b, hg, skv, dqk], self.strides("K", b, hg, dqk))
            v = self.t("V", [b, hg, skv, dv], self.strides("V", b, hg, dv))
            if x.ragged_kv:
                off_k = self.offset("offset_k", b, odt)
                off_v = self.offset("offset_v", b, odt)
                self.attach(k, off_k, "k", mult)
                self.attach(v, off_v, "v", mult)
        kw: dict[str, Any] = {"attn_scale": self.scalar("attn_scale", by_value=True)}
        self.masking(kw, fp8=False)
        kw["use_alibi_mask"] = x.alibi
        self.bias(kw, bwd=False)
        self.padding(kw, b, fwd=True)
        if x.paged:
            n = x.max_pages_per_seq  # TE: page_table_k strides {mpps_k, mpps_v, 1, 1} (sic)
            kw["paged_attention_k_table"] = self.t("page_table_k", [b, 1, n, 1], [n, n, 1, 1],
                                                   dt.INT32)  # fmt: skip
            kw["paged_attention_v_table"] = self.t("page_table_v", [b, 1, n, 1], [n, n, 1, 1],
                                                   dt.INT32)  # fmt: skip
            kw["paged_attention_max_seq_len_kv"] = skv
        self.dropout(kw)
        self.sink(kw, bwd=False)
        off_stats = self.offset("offset_stats", b, odt) if x.uses_ragged_stats else None
        if x.return_max_logit:
            mx = self.t("Max", [b, h, sq, 1], self.stats_stride(b), dt.FLOAT)
            if off_stats is not None:
                self.attach(mx, off_stats, "stats", mult)
            kw["score_max"] = mx
        o, stats = self.g.sdpa(q, k, v, generate_stats=True, name="flash_attention", **kw)
        o.set_output(True).set_dim([b, h, sq, dv]).set_stride(self.strides("O", b, h, dv))
        if x.ragged_q:
            self.attach(o, self.offset("offset_o", b, odt), "o", mult)
        stats.set_output(True).set_data_type(dt.FLOAT).set_dim([b, h, sq, 1])
        stats.set_stride(self.stats_stride(b))
        if off_stats is not None:
            self.attach(stats, off_stats, "stats", mult)

    def _bwd_inputs(self, stats_name: str, dtypes: tuple[Any, ...]) -> tuple[Any, ...]:
        """The backward graphs' inputs, in TE's creation order (``create_graph_f16_bwd`` and
        ``create_graph_fp8_bwd`` agree): Q, K, V, O, dO (``dtypes``: their data types, ``None``
        where TE sets none), their ragged offsets (always ``ragged_offset_type_bwd``, INT64; dO
        shares O's), and the stats with ``offset_stats`` when they are ragged. Returns
        ``(q, k, v, o, d_o, stats, offsets)``."""
        x, dt = self.d, self.dt
        b, h, hg, dqk, dv = x.graph_batch_size_bwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        odt = x.ragged_offset_type_bwd
        qs, ks = self.strides("Q", b, h, dqk), self.strides("K", b, hg, dqk)
        vs, os_ = self.strides("V", b, hg, dv), self.strides("O", b, h, dv)
        q = self.t("Q", [b, h, sq, dqk], qs, dtypes[0])
        k = self.t("K", [b, hg, skv, dqk], ks, dtypes[1])
        v = self.t("V", [b, hg, skv, dv], vs, dtypes[2])
        o = self.t("O", [b, h, sq, dv], os_, dtypes[3])
        d_o = self.t("dO", [b, h, sq, dv], os_, dtypes[4])
        off: dict[str, Any] = {}
        if x.ragged_q:
            off["q"], off["o"] = self.offset("offset_q", b, odt), self.offset("offset_o", b, odt)
            for tensor, role in ((q, "q"), (o, "o"), (d_o, "o")):
                tensor.set_ragged_offset(off[role])
        if x.ragged_kv:
            off["k"], off["v"] = self.offset("offset_k", b, odt), self.offset("offset_v", b, odt)
            k.set_ragged_offset(off["k"])
            v.set_ragged_offset(off["v"])
        stats = self.t(stats_name, [b, h, sq, 1], self.stats_stride(b), dt.FLOAT)
        if x.uses_ragged_stats:
            stats.set_ragged_offset(self.offset("offset_stats", b, odt))
        return q, k, v, o, d_o, stats, off

    def f16_backward(self) -> None:
        """``create_graph_f16_bwd`` (fused_attn_f16_arbitrary_seqlen.cu)."""
        x = self.d
        b, h, hg, dqk, dv = x.graph_batch_size_bwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        q, k, v, o, d_o, stats, off = self._bwd_inputs("stats", (None,) * 5)
        qs, ks, vs = (t.get_stride() for t in (q, k, v))
        kw: dict[str, Any] = {"attn_scale": self.scalar("attn_scale", by_value=True)}
        # max_total_seq_len: q iff ragged stats, kv iff ragged kv on the ragged graph (2.20.2
        # binary 0x1965f11-0x1965f4f); never in the forward.
        if x.uses_ragged_stats:
            kw["max_total_seq_len_q"] = sq
        if x.ragged_kv and x.uses_ragged_graph:
            kw["max_total_seq_len_kv"] = skv
        self.masking(kw, fp8=False)
        kw["use_deterministic_algorithm"] = x.deterministic
        kw["use_alibi_mask"] = x.alibi
        self.bias(kw, bwd=True)
        self.padding(kw, b, fwd=False)
        self.dropout(kw)
        self.sink(kw, bwd=True)
        dq, dk, dv_ = self.g.sdpa_backward(
            q, k, v, o, d_o, stats, name="flash_attention_backward", **kw
        )
        dq.set_output(True).set_dim([b, h, sq, dqk]).set_stride(qs)
        dk.set_output(True).set_dim([b, hg, skv, dqk]).set_stride(ks)
        dv_.set_output(True).set_dim([b, hg, skv, dv]).set_stride(vs)
        if x.ragged_q:
            dq.set_ragged_offset(off["q"])
        if x.ragged_kv:
            dk.set_ragged_offset(off["k"])
            dv_.set_ragged_offset(off["v"])

    # -------------------------------------------------------------- FP8 (per-tensor scaling)
    def fp8_forward(self) -> None:
        """``create_graph_fp8_fwd`` (fused_attn_fp8.cu), per-tensor (delayed / current)
        scaling: scalar FLOAT ``Descale_q``/``Descale_q`` (TE names K's descale like Q's)/
        ``Descale_v``/``Descale_s``/``Scale_s``, ``Scale_o`` a real input for delayed and a
        constant 1.0 for current scaling; outputs O (o dtype), Stats, ``amax_s``, ``amax_o``."""
        x, dt, cd = self.d, self.dt, self.cudnn
        b, h, hg, dqk, dv = x.graph_batch_size_fwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        odt, mult = x.ragged_offset_type_fwd, x.uses_cu_seqlens_directly
        io = _dtype(cd, x.qkv_dtype)
        q = self.t("Q", [b, h, sq, dqk], self.strides("Q", b, h, dqk), io)
        if x.ragged_q:
            self.attach(q, self.offset("offset_q", b, odt), "q", mult)
        k = self.t("K", [b, hg, skv, dqk], self.strides("K", b, hg, dqk), io)
        v = self.t("V", [b, hg, skv, dv], self.strides("V", b, hg, dv), io)
        if x.ragged_kv:
            off_k, off_v = self.offset("offset_k", b, odt), self.offset("offset_v", b, odt)
            self.attach(k, off_k, "k", mult)
            self.attach(v, off_v, "v", mult)
        attn_scale = self.scalar("attn_scale", by_value=True)
        descale_q = self.scalar("Descale_q")
        descale_k = self.g.tensor_like(descale_q, "Descale_q")
        descale_v = self.g.tensor_like(descale_q, "Descale_v")
        descale_s = self.g.tensor_like(descale_q, "Descale_s")
        scale_s = self.g.tensor_like(descale_q, "Scale_s")
        scale_o = self.g.tensor_like(descale_q, "Scale_o") if x.fp8_delayed else self.one()
        kw: dict[str, Any] = {"attn_scale": attn_scale}
        self.masking(kw, fp8=True)
        self.padding(kw, b, fwd=True)
        self.dropout(kw)
        self.sink(kw, bwd=False)
        o, stats, amax_s, amax_o = self.g.sdpa_fp8(
            q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o,
            generate_stats=True, name="sdpa_fp8", **kw,
        )  # fmt: skip
        amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
        amax_s.set_data_type(dt.FLOAT)
        o.set_output(True).set_dim([b, h, sq, dv]).set_stride(self.strides("O", b, h, dv))
        o.set_data_type(_dtype(cd, x.o_dtype))
        if x.ragged_q:
            self.attach(o, self.offset("offset_o", b, odt), "o", mult)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
        amax_o.set_data_type(dt.FLOAT)
        stats.set_output(True).set_data_type(dt.FLOAT).set_dim([b, h, sq, 1])
        stats.set_stride(self.stats_stride(b))
        if x.uses_ragged_stats:
            self.attach(stats, self.offset("offset_stats", b, odt), "stats", mult)

    def fp8_backward(self) -> None:
        """``create_graph_fp8_bwd`` (fused_attn_fp8.cu), per-tensor scaling: O in o dtype, dO in
        the gradient type, dQ/dK/dV in ``dqkv_dtype``; ``Descale_O`` a constant 1.0 for current
        scaling with O in F16, ``Scale_dQ/dK/dV`` real for delayed and 1.0 for current; outputs
        amax_dQ/dK/dV/dP. Deterministic only with cuDNN >= 9.19; no max_total_seq_len."""
        x, dt, cd = self.d, self.dt, self.cudnn
        b, h, hg, dqk, dv = x.graph_batch_size_bwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        io = _dtype(cd, x.qkv_dtype)
        q, k, v, o, d_o, stats, off = self._bwd_inputs(
            "Stats", (io, io, io, _dtype(cd, x.o_dtype), _dtype(cd, x.do_dtype)))
        qs, ks, vs = (t.get_stride() for t in (q, k, v))
        attn_scale = self.scalar("attn_scale", by_value=True)
        descale_q = self.scalar("Descale_q")
        like = self.g.tensor_like
        descale_k, descale_v = like(descale_q, "Descale_q"), like(descale_q, "Descale_v")
        descale_s, scale_s = like(descale_q, "Descale_s"), like(descale_q, "Scale_s")
        descale_dp, scale_dp = like(descale_q, "Descale_dP"), like(descale_q, "Scale_dP")
        o_in_f16 = x.o_dtype in ("fp16", "bf16")
        descale_o = self.one() if x.fp8_current and o_in_f16 else like(descale_q, "Descale_O")
        descale_do = like(descale_q, "Descale_dO")
        if x.fp8_delayed:
            scale_dq, scale_dk = like(descale_q, "Scale_dQ"), like(descale_q, "Scale_dK")
            scale_dv = like(descale_q, "Scale_dV")
        else:
            scale_dq, scale_dk, scale_dv = self.one(), self.one(), self.one()
        kw: dict[str, Any] = {"attn_scale": attn_scale}
        self.masking(kw, fp8=True)
        if x.cudnn_version >= 91900:
            kw["use_deterministic_algorithm"] = x.deterministic
        self.padding(kw, b, fwd=False)
        self.dropout(kw)
        self.sink(kw, bwd=True)
        outs = self.g.sdpa_fp8_backward(
            q, k, v, o, d_o, stats, descale_q, descale_k, descale_v, descale_o, descale_do,
            descale_s, descale_dp, scale_s, scale_dq, scale_dk, scale_dv, scale_dp,
            name="sdpa_fp8_backward", **kw,
        )  # fmt: skip
        dq, dk, dv_ = outs[:3]
        dqkv = _dtype(cd, x.dqkv_dtype)
        for t, dim, stride in ((dq, [b, h, sq, dqk], qs), (dk, [b, hg, skv, dqk], ks),
                               (dv_, [b, hg, skv, dv], vs)):  # fmt: skip
            t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(dqkv)
        if x.ragged_q:
            dq.set_ragged_offset(off["q"])
        if x.ragged_kv:
            dk.set_ragged_offset(off["k"])
            dv_.set_ragged_offset(off["v"])
        for a in outs[3:7]:
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
            a.set_data_type(dt.FLOAT)

    def build(self, which: str) -> None:
        if self.d.fp8:
            self.fp8_forward() if which == "fwd" else self.fp8_backward()
        else:
            self.f16_forward() if which == "fwd" else self.f16_backward()


# ---------------------------------------------------------------------------------------- probing
def _resolve_device(device: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A catalog name or a descriptor, validated; ``None`` stays ``None`` (no descriptor: only
    a real handle can plan then)."""
    from ..descriptors import DescriptorError, load_descriptor, validate_descriptor

    if device is None:
        return None
    if isinstance(device, str):
        return load_descriptor(device)
    if not isinstance(device, Mapping):
        raise DescriptorError(
            f"a device descriptor is a JSON object or a catalog name, got {type(device).__name__}"
        )
    desc = dict(device)
    validate_descriptor(desc)
    return desc


def _config(config: FusedAttnConfig | Mapping[str, Any]) -> FusedAttnConfig:
    if isinstance(config, FusedAttnConfig):
        return config
    return FusedAttnConfig.from_dict(config)


def probe_config(
    config: FusedAttnConfig | Mapping[str, Any],
    device: str | Mapping[str, Any] | None,
    sm: int | None = None,
    *,
    build_plans: bool = False,
    heuristics: tuple[str, ...] = HEURISTICS,
    use_real_gpu: bool = False,
    spec: bool = False,
) -> dict[str, Any]:
    """Build the config's SDPA graph(s) for ``device`` and return cuDNN's answer (module doc).

    ``config``: a :class:`FusedAttnConfig` or its ``to_dict()``. ``device``: a catalog name
    (``"h100"``), a descriptor dict, or ``None`` (only with ``use_real_gpu``: the real device
    is described by itself). ``sm``: the ``sm_version`` to plan for (default: the descriptor's
    ``deviceVer // 10``, or the real device's). ``build_plans``: also compile the plans (slow).
    ``heuristics``: cuDNN heuristic modes; the first (heur_mode.A, the only one TE asks) gives
    the verdict, the others are asked only for a note when it finds no supported plan.
    ``spec``: add ``graph_spec`` (``{"fwd": <cudnn-frontend JSON>, "bwd": ...}`` of each graph
    built, taken after ``validate``, or as far as it got when building or validating failed) and
    ``derived`` (TE's derived config, :class:`TEGraphConfig`). ``use_real_gpu``: plan on this
    process's current GPU with a real cuDNN handle (mode ``"device"``) where a real driver with
    a GPU is loaded; elsewhere (the stub driver) plan deviceless with the descriptor and say so
    in ``notes``. A failed handle falls back to the
    descriptor too. The real-handle path **never ran on a GPU** (only with a fake handle).
    """
    t0 = time.perf_counter()
    notes: list[str] = []

    def done(**kw: Any) -> dict[str, Any]:
        kw["elapsed_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        kw["notes"] = notes + list(kw.get("notes") or [])
        return _result(**kw)

    try:
        cfg = _config(config)
    except (ValueError, TypeError) as exc:
        return done(code="cudnn.probe_error", step="mapping", message=f"invalid config: {exc}")
    try:
        desc = _resolve_device(device)
    except (ValueError, TypeError) as exc:
        return done(code="cudnn.bad_descriptor", step="device", message=str(exc))
    from ..descriptors import cudnn_json, descriptor_sm

    no_desc = (
        "no device descriptor: deviceless planning needs one (a catalog name or a descriptor)"
    )
    if desc is None and not use_real_gpu:
        return done(code="cudnn.bad_descriptor", step="device", message=no_desc)
    if sm is not None:
        sm = int(sm)
    elif desc is not None:
        sm = descriptor_sm(desc)
    base: dict[str, Any] = {"sm": sm, "device": desc.get("deviceName") if desc else None}
    st = backend_status()
    base.update(
        cudnn_version=st["cudnn_version"],
        frontend_version=st["frontend_version"],
        driver=st["driver"],
    )
    if not st["ok"]:
        return done(code="cudnn.unavailable", step="backend", message=st["error"], **base)
    real = use_real_gpu and st["driver"] == "real"
    if use_real_gpu and not real:
        notes.append(
            f"asked to plan on the local GPU with a real handle, but this process sees no GPU "
            f"({st['driver']} driver loaded): planned deviceless with the descriptor"
            + (f" of {base['device']} (sm{sm})" if desc is not None else "")
        )
    if desc is None and not real:
        return done(
            code="cudnn.bad_descriptor",
            step="device",
            message=f"{no_desc}, and no real GPU driver is loaded here to plan with a real handle",
            **base,
        )
    try:
        _check_expressible(cfg)
    except _Unsupported as exc:
        return done(code=exc.code, step="mapping", message=str(exc), **base)

    import cudnn

    graph_kw: dict[str, Any] = {}
    if real:  # gpu-only
        try:
            if sm is None or desc is None:
                sm, name = _real_device(sm)
                base.update(sm=sm, device=base["device"] or name)
            graph_kw["handle"] = backend_handle(_real_handle(cudnn))
        except Exception as exc:  # noqa: BLE001 - no handle: the descriptor, if any, answers
            if desc is None:
                return done(
                    code="cudnn.probe_error",
                    step="device",
                    message=f"planning with a real cuDNN handle on the local GPU failed: "
                    f"{type(exc).__name__}: {exc}",
                    error_type=type(exc).__name__,
                    **base,
                )
            notes.append(
                f"planning with a real cuDNN handle on the local GPU failed "
                f"({type(exc).__name__}: {exc}): planned deviceless with the descriptor"
            )
            real = False
            graph_kw.clear()
    base["mode"] = "device" if real else "deviceless"
    if not real:
        assert desc is not None and sm is not None
        try:
            graph_kw["device_property"] = _device_properties(cudnn, cudnn_json(desc))
            graph_kw["sm_version"] = sm
        except Exception as exc:  # noqa: BLE001 - cuDNN refusing the descriptor
            return done(
                code="cudnn.bad_descriptor",
                step="device",
                message=str(exc),
                summary=summarize(str(exc)),
                error_type=type(exc).__name__,
                **base,
            )
    assert sm is not None
    d = derive(cfg, sm, int(st["version_int"]))
    spec_out: dict[str, Any] = {}
    extra: dict[str, Any] = {"graph_spec": spec_out, "derived": d.to_dict()} if spec else {}
    refusal = te_refusal(cfg, d)
    if refusal is not None:
        return done(
            decided=True,
            code="cudnn.te_refused",
            step="derive",
            message="TE 2.20.2 refuses before building a graph (nvte_get_fused_attn_backend_v2): "
            + refusal,
            summary=refusal,
            notes=list(d.notes),
            **extra,
            **base,
        )
    try:
        _check_fp8_expressible(cfg)
    except _Unsupported as exc:
        return done(code=exc.code, step="mapping", message=str(exc), **extra, **base)
    notes.extend(d.notes)
    io = _io_dtype(cudnn, d)
    plans: dict[str, list[str]] = {}
    modes: dict[str, str] = {}
    graphs = ("fwd", "bwd") if cfg.is_training else ("fwd",)
    for which in graphs:
        outcome = _run_graph(cudnn, which, d, io, graph_kw, build_plans, tuple(heuristics), spec)
        if spec and outcome.get("spec") is not None:
            spec_out[which] = outcome["spec"]
        notes.extend(outcome.get("notes") or [])
        modes[which] = heuristics[0]
        if not outcome["ok"]:
            fail = dict(outcome["fail"])
            fail.pop("heur_mode", None)
            return done(plans=plans, heur_mode=modes, graph=which, **fail, **extra, **base)
        plans[which] = outcome["plans"]
    return done(supported=True, decided=True, plans=plans, heur_mode=modes, **extra, **base)


def _graph_json(g: Any) -> Any:
    """The cudnn-frontend JSON of a graph as built so far (its own vocabulary, the same JSON
    ``CUDNN_FRONTEND_LOG_INFO=1`` logs)."""
    try:
        return json.loads(str(g))
    except Exception as exc:  # noqa: BLE001 - a half-built graph may not serialize
        return {"error": f"{type(exc).__name__}: {exc}"}


def _run_graph(
    cudnn: Any,
    which: str,
    d: TEGraphConfig,
    io: Any,
    graph_kw: dict[str, Any],
    build_plans: bool,
    heuristics: tuple[str, ...],
    spec: bool = False,
) -> dict[str, Any]:
    """One graph through TE's pipeline with ``heuristics[0]`` (heur_mode.A: the only mode TE
    2.20.2 asks, graph_cache.h ``query_support``), whose answer is the verdict. When it finds no
    supported plan, the other modes are asked too, only for a note saying whether they would
    have offered one."""
    outcome = _run_graph_once(cudnn, which, d, io, graph_kw, build_plans, heuristics[0], spec)
    outcome["notes"] = []
    if outcome["ok"] or outcome["step"] not in ("create_execution_plans", "check_support"):
        return outcome
    for mode in heuristics[1:]:
        other = _run_graph_once(cudnn, which, d, io, graph_kw, False, mode, False)
        if other["ok"]:
            outcome["notes"].append(
                f"{which}: heur_mode.{heuristics[0]} proposed no supported plan; "
                f"heur_mode.{mode} would have offered {len(other['plans'])} "
                f"({', '.join(other['plans'][:3])}{', ...' if len(other['plans']) > 3 else ''}); "
                f"the verdict is heur_mode.{heuristics[0]}'s (TE 2.20.2 asks heur_mode.A only)"
            )
            break
    return outcome


def _run_graph_once(
    cudnn: Any,
    which: str,
    d: TEGraphConfig,
    io: Any,
    graph_kw: dict[str, Any],
    build_plans: bool,
    mode: str,
    spec: bool = False,
) -> dict[str, Any]:
    dt = cudnn.data_type
    step = "build_graph"
    g = None
    graph_json = None
    try:
        g = cudnn._pybind_module.backend_graph(
            io_data_type=io,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            **graph_kw,
        )
        _Builder(cudnn, g, d).build(which)
        step = "validate"
        g.validate()
        if spec:
            graph_json = _graph_json(g)
        step = "build_operation_graph"
        g.build_operation_graph()
        step = "create_execution_plans"
        g.create_execution_plans([getattr(cudnn.heur_mode, mode)])
        step = "check_support"
        g.check_support()
        names = [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]
        if build_plans:
            step = "build_plans"
            g.build_plans()
        return {"ok": True, "plans": names, "step": None, "spec": graph_json}
    except Exception as exc:  # noqa: BLE001 - cuDNN's refusal, or a mapping error (below)
        mapping_error = isinstance(exc, (TypeError, AttributeError, KeyError, IndexError))
        if step != "build_graph" and not mapping_error:
            text = str(exc)  # cuDNN's refusal (cudnnGraphNotSupportedError ...)
            fail = {"decided": True, "code": "cudnn.not_supported", "step": step,
                    "message": text, "summary": summarize(text),
                    "error_type": type(exc).__name__, "heur_mode": mode}  # fmt: skip
        else:
            # A Python-level error in our mapping (or an API change), or the frontend binding
            # refusing what it was handed while the graph was put together (TE's C++ builds
            # the same graph without such checks; cuDNN judges it at validate): undecided.
            msg = f"{type(exc).__name__}: {exc}"
            fail = {"code": "cudnn.probe_error", "step": step, "message": msg, "summary": msg,
                    "error_type": type(exc).__name__}  # fmt: skip
    if spec and graph_json is None and g is not None:
        graph_json = _graph_json(g)
    return {"ok": False, "plans": None, "step": step, "fail": fail, "spec": graph_json}


def _reset_for_tests() -> None:
    global _backend
    with _lock:
        _backend = None
        _device_props.clear()
        _handles.clear()


__all__ = [
    "PIPELINE",
    "TEGraphConfig",
    "backend_handle",
    "backend_status",
    "derive",
    "layout_pieces",
    "probe_config",
    "strides_bhsd",
    "summarize",
    "te_matrix_strides",
    "te_refusal",
]

if __name__ == "__main__":  # pragma: no cover - manual check: python -m ...cudnn_graph h100
    import json

    print(
        json.dumps(
            probe_config(FusedAttnConfig(), sys.argv[1] if len(sys.argv) > 1 else "h100"), indent=2
        )
    )
