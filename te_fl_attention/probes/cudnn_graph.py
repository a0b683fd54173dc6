"""Ask cuDNN itself: build the SDPA graph TransformerEngine would build and let cuDNN decide.

:func:`probe_config` maps one :class:`~te_fl_attention.config.FusedAttnConfig` (as its
``to_dict()``, so a worker process gets plain JSON) to cudnn-frontend SDPA graphs, the forward
one and, for training, the backward one, shaped the way TE 2.x's
``fused_attn_f16_arbitrary_seqlen`` / ``fused_attn_fp8`` build them (tensor dims ``[b, h, s, d]``,
strides from the QKV layout, a pass-by-value float ``attn_scale``, seq-len tensors for padding,
ragged offsets for ``thd``, diagonal alignment and band bounds for causal masks and sliding
windows, a ``[1, h, 1, 1]`` sink tensor for off-by-one / learnable softmax, stats always
generated). Then it runs cuDNN's own pipeline::

    validate -> build_operation_graph -> create_execution_plans(heur_mode) -> check_support
    (-> build_plans, off by default: it compiles kernels and takes ~0.3 s)

with heur_mode.A first and heur_mode.FALLBACK only when A yields no supported plan (TE itself
asks A only; a graph only FALLBACK serves is flagged in ``heur_mode`` and ``notes``).

and reports what cuDNN said, its exception text verbatim. The graphs are the cudnn-frontend C++
graph (``cudnn._pybind_module.backend_graph``), the one TE drives through the C++ API: only cuDNN
backend engines are considered. The frontend's Python-native engines (``cudnn.pygraph``'s "FROST"
engines) are left out on purpose, because TE cannot dispatch to them.

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
     "decided": bool,            # cuDNN itself answered (False: the probe could not ask)
     "code": str | None,         # None, "cudnn.not_supported", "cudnn.unavailable",
                                 # "cudnn.unsupported_by_probe", "cudnn.fp8_unsupported_by_probe",
                                 # "cudnn.bad_descriptor", "cudnn.probe_error"
     "step": str | None,         # the failed step: build_graph, validate, build_operation_graph,
                                 # create_execution_plans, check_support, build_plans; or the
                                 # probe's own: backend, device, mapping
     "graph": "fwd" | "bwd" | None,
     "message": str | None,      # cuDNN's exception text, verbatim
     "summary": str | None,      # its first line plus the specific "Reason:" lines, deduplicated
     "error_type": str | None,
     "cudnn_version": "9.28.1", "frontend_version": "1.32.0",
     "mode": "deviceless" | "device", "driver": "stub" | "real" | "real-nodevice" | ...,
     "sm": 90, "device": "NVIDIA H100 80GB HBM3",
     "plans": {"fwd": [names...], "bwd": [names...]},
     "heur_mode": {"fwd": "A", "bwd": "A"},   # the mode whose plans are listed
     "notes": [str, ...],        # what the mapping assumed or left out
     "elapsed_ms": float}
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..config import FusedAttnConfig

#: The pipeline, in order (``build_plans`` only when asked).
PIPELINE = ("validate", "build_operation_graph", "create_execution_plans", "check_support")

#: Heuristic modes tried in order (a mode is tried only when the ones before it found no plan).
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
class _Unsupported(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _check_expressible(c: FusedAttnConfig) -> None:
    """Features the probe cannot put into a cuDNN SDPA graph: refuse honestly, undecided."""
    u = "cudnn.unsupported_by_probe"
    if c.fp8 and c.fp8_recipe not in FP8_PROBED_RECIPES:
        raise _Unsupported(
            "cudnn.fp8_unsupported_by_probe",
            f"fp8_recipe={c.fp8_recipe}: the probe builds FP8 graphs only for per-tensor scaling "
            f"({', '.join(FP8_PROBED_RECIPES)}) with sdpa_fp8; block-scaled recipes "
            "(sdpa_mxfp8 ...) are not mapped",
        )
    if c.bias_type == "pre_scale_bias":
        raise _Unsupported(u, "pre_scale_bias: cuDNN's SDPA node takes only a post-scale bias")
    if c.bias_type == "alibi" and c.alibi_slopes_shape is not None:
        raise _Unsupported(
            u,
            f"ALiBi with custom slopes {list(c.alibi_slopes_shape)}: cuDNN's SDPA node only has "
            "use_alibi_mask (the standard slopes)",
        )
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
    if c.fp8 and c.bias_type != "no_bias":
        raise _Unsupported(
            u, f"FP8 attention with bias_type={c.bias_type}: TE's FP8 graph takes no bias"
        )
    if c.paged and c.is_training:
        raise _Unsupported(u, "a paged KV cache in training: TE builds no paged backward graph")
    if c.attn_mask_type == "arbitrary":
        raise _Unsupported(u, "attn_mask_type=arbitrary: no cuDNN SDPA mask attribute for it")


class _Shapes:
    """Dims, strides and flags of one config, computed once for both graphs."""

    def __init__(self, c: FusedAttnConfig, sm: int) -> None:
        self.c = c
        b, h, hg = c.batch_size, c.num_heads, c.num_gqa_groups
        sq, skv, dqk, dv = c.max_seqlen_q, c.max_seqlen_kv, c.head_dim_qk, c.head_dim_v
        self.b, self.h, self.hg, self.sq, self.skv, self.dqk, self.dv = b, h, hg, sq, skv, dqk, dv
        qf, kf, vf = layout_pieces(c.qkv_layout)
        self.q_fmt, self.k_fmt, self.v_fmt = qf, kf, vf
        self.ragged_q = "t" in qf
        self.ragged_kv = "t" in kf
        self.paged = c.paged
        m = c.attn_mask_type
        self.padding = "padding" in m or self.ragged_q or self.ragged_kv or self.paged
        self.causal = "causal" in m
        self.notes: list[str] = []
        if (self.ragged_q or self.ragged_kv) and "padding" not in m:
            self.notes.append(f"thd input: padding mask implied (TE requires one; was {m})")
        if self.paged and "padding" not in m:  # pragma: no cover - config forces padding
            self.notes.append("paged KV: padding mask implied")
        self.q_stride = strides_bhsd(qf, {"b": b, "s": sq, "h": h, "d": dqk})
        if self.paged:
            ps = c.page_size
            self.pages_per_seq = -(-skv // ps)
            self.num_pages = b * self.pages_per_seq
            kv_sizes = {"b": self.num_pages, "s": ps, "h": hg}
            self.k_dim = [self.num_pages, hg, ps, dqk]
            self.v_dim = [self.num_pages, hg, ps, dv]
        else:
            kv_sizes = {"b": b, "s": skv, "h": hg}
            self.k_dim = [b, hg, skv, dqk]
            self.v_dim = [b, hg, skv, dv]
        self.k_stride = strides_bhsd(kf, {**kv_sizes, "d": dqk})
        self.v_stride = strides_bhsd(vf, {**kv_sizes, "d": dv})
        self.o_stride = strides_bhsd(_plain(qf), {"b": b, "s": sq, "h": h, "d": dv})
        self.q_dim = [b, h, sq, dqk]
        self.o_dim = [b, h, sq, dv]
        # TE keeps stats in thd order ([t, h]) on the ragged path, except on sm120.
        self.ragged_stats = self.ragged_q and sm != 120
        self.stats_stride = [h * sq, 1, h, 1] if self.ragged_stats else [h * sq, sq, 1, 1]
        if c.bias_shape is not None:
            code = c.bias_shape
            self.bias_dim = [
                b if code[0] == "b" else 1,
                h if code[1] == "h" else 1,
                1 if code == "111s" else sq,
                skv,
            ]
        else:
            self.bias_dim = None
        self.dropout = c.dropout if c.is_training else 0.0
        # TE: diagonal alignment from bottom_right_diagonal, left bound = left + 1,
        # right bound = right (or 0 for causal masks).
        left, right = c.window_size  # type: ignore[misc]
        self.align = "BOTTOM_RIGHT" if c.bottom_right_diagonal else "TOP_LEFT"
        self.left_bound = left + 1 if left != -1 else None
        self.right_bound = 0 if self.causal else (right if right != -1 else None)
        if c.num_splits > 1:
            self.notes.append(f"num_splits={c.num_splits} ignored (no cuDNN graph attribute)")


def _io_dtype(cudnn: Any, c: FusedAttnConfig) -> Any:
    dt = cudnn.data_type
    if c.fp8:
        return dt.FP8_E5M2 if c.dtype == "fp8_e5m2" else dt.FP8_E4M3
    return {"fp16": dt.HALF, "bf16": dt.BFLOAT16, "fp32": dt.FLOAT}[c.dtype]


class _Builder:
    """Builds the forward or backward graph of one config on one backend graph object."""

    def __init__(self, cudnn: Any, g: Any, s: _Shapes, io: Any) -> None:
        self.cudnn, self.g, self.s, self.io = cudnn, g, s, io
        self.dt = cudnn.data_type
        self.offset_dtype = self.dt.INT64

    def t(self, name: str, dim: list[int], stride: list[int], dtype: Any = None, **kw: Any) -> Any:
        return self.g.tensor(
            name=name, dim=dim, stride=stride, data_type=self.io if dtype is None else dtype, **kw
        )

    def scalar(self, name: str, dtype: Any = None, by_value: bool = False) -> Any:
        return self.t(
            name,
            [1, 1, 1, 1],
            [1, 1, 1, 1],
            self.dt.FLOAT if dtype is None else dtype,
            is_pass_by_value=by_value,
        )

    def offsets(self, name: str) -> Any:
        return self.t(name, [self.s.b + 1, 1, 1, 1], [1, 1, 1, 1], self.offset_dtype)

    def qkv(self, with_offsets: dict[str, Any]) -> tuple[Any, Any, Any]:
        s = self.s
        q = self.t("Q", s.q_dim, s.q_stride, ragged_offset=with_offsets.get("q"))
        k = self.t("K", s.k_dim, s.k_stride, ragged_offset=with_offsets.get("k"))
        v = self.t("V", s.v_dim, s.v_stride, ragged_offset=with_offsets.get("v"))
        return q, k, v

    def ragged_offsets(self) -> dict[str, Any]:
        s, off = self.s, {}
        if s.ragged_q:
            off["q"] = self.offsets("offset_q")
            off["o"] = self.offsets("offset_o")
        if s.ragged_kv:
            off["k"] = self.offsets("offset_k")
            off["v"] = self.offsets("offset_v")
        if s.ragged_stats:
            off["stats"] = self.offsets("offset_stats")
        return off

    def common_kwargs(self, fp8: bool) -> dict[str, Any]:
        s, c, kw = self.s, self.s.c, {}
        kw["attn_scale"] = self.scalar("attn_scale", by_value=True)
        kw["diagonal_alignment"] = getattr(self.cudnn.diagonal_alignment, s.align)
        if fp8:
            left_key, right_key = "left_bound", "right_bound"
        else:
            left_key, right_key = "diagonal_band_left_bound", "diagonal_band_right_bound"
        if s.left_bound is not None:
            kw[left_key] = s.left_bound
        if s.right_bound is not None:
            kw[right_key] = s.right_bound
        if s.padding:
            seq = [s.b, 1, 1, 1]
            kw["use_padding_mask"] = True
            kw["seq_len_q"] = self.t("seq_q", seq, [1, 1, 1, 1], self.dt.INT32)
            kw["seq_len_kv"] = self.t("seq_kv", seq, [1, 1, 1, 1], self.dt.INT32)
        if not fp8 and c.bias_type == "alibi":
            kw["use_alibi_mask"] = True
        if s.dropout:
            seed = self.scalar("Seed", self.dt.INT64)
            offset = self.scalar("Offset", self.dt.INT64)
            kw["dropout"] = (s.dropout, seed, offset)
        if c.softmax_type != "vanilla":
            kw["sink_token"] = self.t(
                "softmax_offset", [1, s.h, 1, 1], [s.h, 1, 1, 1], self.dt.FLOAT
            )
        if s.ragged_q:
            kw["max_total_seq_len_q"] = s.b * s.sq
        if s.ragged_kv:
            kw["max_total_seq_len_kv"] = s.b * s.skv
        return kw

    def bias(self) -> Any:
        s = self.s
        if s.bias_dim is None:
            return None
        bd = s.bias_dim
        return self.t("bias", bd, [bd[1] * bd[2] * bd[3], bd[2] * bd[3], bd[3], 1])

    def paged_kwargs(self) -> dict[str, Any]:
        s = self.s
        if not s.paged:
            return {}
        n = s.pages_per_seq
        return {
            "paged_attention_k_table": self.t(
                "page_table_k", [s.b, 1, n, 1], [n, n, 1, 1], self.dt.INT32
            ),
            "paged_attention_v_table": self.t(
                "page_table_v", [s.b, 1, n, 1], [n, n, 1, 1], self.dt.INT32
            ),
            "paged_attention_max_seq_len_kv": s.skv,
        }

    def stats_tensor_out(self, t: Any, off: dict[str, Any]) -> None:
        s = self.s
        t.set_output(True).set_data_type(self.dt.FLOAT).set_dim([s.b, s.h, s.sq, 1])
        t.set_stride(s.stats_stride)
        if "stats" in off:
            t.set_ragged_offset(off["stats"])

    # -------------------------------------------------------------- forward
    def forward(self) -> None:
        s, c = self.s, self.s.c
        off = self.ragged_offsets()
        q, k, v = self.qkv(off)
        kw = self.common_kwargs(fp8=c.fp8)
        kw.update(self.paged_kwargs())
        if c.return_max_logit:
            mx = self.t("Max", [s.b, s.h, s.sq, 1], s.stats_stride, self.dt.FLOAT)
            if "stats" in off:
                mx.set_ragged_offset(off["stats"])
            mx.set_output(True)
            kw["score_max"] = mx
        if c.fp8:
            names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
            scales = [self.scalar(n) for n in names]
            outs = self.g.sdpa_fp8(q, k, v, *scales, generate_stats=True, name="sdpa_fp8", **kw)
            o, stats, amax_s, amax_o = outs[:4]
            for a in (amax_s, amax_o):
                a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
                a.set_data_type(self.dt.FLOAT)
        else:
            bias = self.bias()
            if bias is not None:
                kw["bias"] = bias
            o, stats = self.g.sdpa(q, k, v, generate_stats=True, name="flash_attention", **kw)
        o.set_output(True).set_dim(s.o_dim).set_stride(s.o_stride).set_data_type(self.io)
        if "o" in off:
            o.set_ragged_offset(off["o"])
        self.stats_tensor_out(stats, off)

    # -------------------------------------------------------------- backward
    def backward(self) -> None:
        s, c = self.s, self.s.c
        off = self.ragged_offsets()
        q, k, v = self.qkv(off)
        o = self.t("O", s.o_dim, s.o_stride, ragged_offset=off.get("o"))
        d_o = self.t("dO", s.o_dim, s.o_stride, ragged_offset=off.get("o"))
        stats = self.t(
            "stats",
            [s.b, s.h, s.sq, 1],
            s.stats_stride,
            self.dt.FLOAT,
            ragged_offset=off.get("stats"),
        )
        kw = self.common_kwargs(fp8=c.fp8)
        kw["use_deterministic_algorithm"] = c.deterministic
        if c.softmax_type != "vanilla":
            d_sink = self.t("d_softmax_offset", [1, s.h, 1, 1], [s.h, 1, 1, 1], self.dt.FLOAT)
            d_sink.set_output(True)
            kw["dSink_token"] = d_sink
        if c.fp8:
            kw.pop("use_alibi_mask", None)
            names = (
                "descale_q",
                "descale_k",
                "descale_v",
                "descale_o",
                "descale_dO",
                "descale_s",
                "descale_dP",
                "scale_s",
                "scale_dQ",
                "scale_dK",
                "scale_dV",
                "scale_dP",
            )
            scales = [self.scalar(n) for n in names]
            outs = self.g.sdpa_fp8_backward(
                q, k, v, o, d_o, stats, *scales, name="sdpa_fp8_backward", **kw
            )
            dq, dk, dv = outs[:3]
            for a in outs[3:7]:
                a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
                a.set_data_type(self.dt.FLOAT)
        else:
            bias = self.bias()
            if bias is not None:
                kw["bias"] = bias
                if c.bias_requires_grad:
                    d_bias = self.t("dBias", s.bias_dim, bias.get_stride())
                    d_bias.set_output(True)
                    kw["dBias"] = d_bias
            dq, dk, dv = self.g.sdpa_backward(
                q, k, v, o, d_o, stats, name="flash_attention_backward", **kw
            )
        for t, dim, stride, key in (
            (dq, s.q_dim, s.q_stride, "q"),
            (dk, s.k_dim, s.k_stride, "k"),
            (dv, s.v_dim, s.v_stride, "v"),
        ):
            t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(self.io)
            if key in off:
                t.set_ragged_offset(off[key])


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
) -> dict[str, Any]:
    """Build the config's SDPA graph(s) for ``device`` and return cuDNN's answer (module doc).

    ``config``: a :class:`FusedAttnConfig` or its ``to_dict()``. ``device``: a catalog name
    (``"h100"``), a descriptor dict, or ``None`` (only with ``use_real_gpu``: the real device
    is described by itself). ``sm``: the ``sm_version`` to plan for (default: the descriptor's
    ``deviceVer // 10``, or the real device's). ``build_plans``: also compile the plans (slow).
    ``heuristics``: cuDNN heuristic modes, tried in order until one yields a supported plan.
    ``use_real_gpu``: plan on this process's current GPU with a real cuDNN handle (mode
    ``"device"``) where a real driver with a GPU is loaded; elsewhere (the stub driver) plan
    deviceless with the descriptor and say so in ``notes``. A failed handle falls back to the
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
    shapes = _Shapes(cfg, sm)
    io = _io_dtype(cudnn, cfg)
    plans: dict[str, list[str]] = {}
    modes: dict[str, str] = {}
    graphs = ("fwd", "bwd") if cfg.is_training else ("fwd",)
    for which in graphs:
        outcome = _run_graph(cudnn, which, shapes, io, graph_kw, build_plans, tuple(heuristics))
        if not outcome["ok"]:
            fail = dict(outcome["fail"])
            modes[which] = fail.pop("heur_mode", None) or heuristics[0]
            return done(
                plans=plans, heur_mode=modes, notes=shapes.notes, graph=which, **fail, **base
            )
        plans[which] = outcome["plans"]
        modes[which] = outcome["heur_mode"]
        if outcome["heur_mode"] != heuristics[0]:
            shapes.notes.append(
                f"{which}: only heur_mode.{outcome['heur_mode']} proposed a supported plan "
                f"(heur_mode.{heuristics[0]} did not; TE 2.x asks heur_mode.A only)"
            )
    return done(
        supported=True, decided=True, plans=plans, heur_mode=modes, notes=shapes.notes, **base
    )


def _run_graph(
    cudnn: Any,
    which: str,
    shapes: _Shapes,
    io: Any,
    graph_kw: dict[str, Any],
    build_plans: bool,
    heuristics: tuple[str, ...],
) -> dict[str, Any]:
    """One graph through the pipeline, once per heuristic mode until one yields a supported plan.

    The first mode's failure is the one reported (for the default ``("A", "FALLBACK")`` that is
    heur_mode.A, the only mode TE 2.x asks). A graph that only FALLBACK supports is reported as
    supported with ``heur_mode="FALLBACK"`` so the caller can tell.
    """
    first_fail: dict[str, Any] | None = None
    for mode in heuristics:
        outcome = _run_graph_once(cudnn, which, shapes, io, graph_kw, build_plans, mode)
        if outcome["ok"]:
            outcome["heur_mode"] = mode
            return outcome
        if first_fail is None:
            first_fail = outcome
        if outcome["step"] not in ("create_execution_plans", "check_support", "build_plans"):
            break  # the graph itself was refused; another heuristic mode cannot change that
    assert first_fail is not None
    return first_fail


def _run_graph_once(
    cudnn: Any,
    which: str,
    shapes: _Shapes,
    io: Any,
    graph_kw: dict[str, Any],
    build_plans: bool,
    mode: str,
) -> dict[str, Any]:
    dt = cudnn.data_type
    step = "build_graph"
    try:
        g = cudnn._pybind_module.backend_graph(
            io_data_type=io,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            **graph_kw,
        )
        builder = _Builder(cudnn, g, shapes, io)
        builder.forward() if which == "fwd" else builder.backward()
        step = "validate"
        g.validate()
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
        return {"ok": True, "plans": names, "step": None}
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        # A Python-level error in our mapping (or an API change), not cuDNN's verdict.
        msg = f"{type(exc).__name__}: {exc}"
        return {
            "ok": False,
            "plans": None,
            "step": step,
            "fail": {
                "code": "cudnn.probe_error",
                "step": step,
                "message": msg,
                "summary": msg,
                "error_type": type(exc).__name__,
            },
        }
    except Exception as exc:  # noqa: BLE001 - cuDNN's refusal (cudnnGraphNotSupportedError ...)
        text = str(exc)
        return {
            "ok": False,
            "plans": None,
            "step": step,
            "fail": {
                "decided": True,
                "code": "cudnn.not_supported",
                "step": step,
                "message": text,
                "summary": summarize(text),
                "error_type": type(exc).__name__,
                "heur_mode": mode,
            },
        }


def _reset_for_tests() -> None:
    global _backend
    with _lock:
        _backend = None
        _device_props.clear()
        _handles.clear()


__all__ = [
    "PIPELINE",
    "backend_handle",
    "backend_status",
    "layout_pieces",
    "probe_config",
    "strides_bhsd",
    "summarize",
]

if __name__ == "__main__":  # pragma: no cover - manual check: python -m ...cudnn_graph h100
    import json

    print(
        json.dumps(
            probe_config(FusedAttnConfig(), sys.argv[1] if len(sys.argv) > 1 else "h100"), indent=2
        )
    )
