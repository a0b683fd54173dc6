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
* :class:`GraphBuilder` is ``create_graph_f16_fwd/bwd`` and ``create_graph_fp8_fwd/bwd``: tensor
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
cannot dispatch to them. What the probe still cannot express (softcap, score_mod, arbitrary
masks, paged KV in training, the MXFP8 graph) is refused undecided (``cudnn.unsupported_by_probe``
/ ``cudnn.fp8_unsupported_by_probe``). Context parallelism is asked as TE asks it: one query per
per-step config (:func:`.cp.cp_steps`, TE's ``cp_per_step_configs``), each step's graphs built
and its verdict kept in ``cp_steps``; the first step refused decides.

Without a GPU this needs cuDNN >= 9.11 "deviceless" mode: a device descriptor
(:mod:`te_fl_attention.descriptors`) plus ``sm_version``, and a loadable ``libcuda.so.1``, which
:mod:`.stubcuda` provides. cuDNN can abort the process on bad input, so call this from the
probe worker (:mod:`.worker`), not from a process you care about.

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
     "derived": {...},                             # TE's derived config (TEGraphConfig)
     # with context parallelism only (plans, heur_mode, graph_spec keyed "fwd[<step>]",
     # derived keyed by step):
     "cp_steps": [{"label", "attn_mask_type", "max_seqlen_q", ..., "supported", "decided",
                   "code", "step", "graph", "summary", "plans"}, ...],
     "cp_step": str}                               # the step that decided a refusal
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Mapping
from typing import Any

from ...config import FusedAttnConfig
from .builder import GraphBuilder, io_dtype
from .cp import CPStep, cp_steps
from .mapping import (
    TEGraphConfig,
    Unsupported,
    check_expressible,
    check_fp8_expressible,
    derive,
    te_refusal,
)

#: The pipeline, in order (``build_plans`` only when asked).
PIPELINE = ("validate", "build_operation_graph", "create_execution_plans", "check_support")

#: Heuristic modes: the first gives the verdict (TE 2.20.2 asks heur_mode.A only, graph_cache.h
#: ``query_support``); the others are asked only for a note when it finds no supported plan.
HEURISTICS = ("A", "FALLBACK")

#: Oldest cuDNN with deviceless planning (device descriptor + sm_version).
MIN_DEVICELESS_CUDNN = 91100


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
def graph_result(**kw: Any) -> dict[str, Any]:
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
    from . import stubcuda

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
    setup = stubcuda.setup_driver()
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
    from ...descriptors import current_ordinal

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
    from ...descriptors import capture_device_descriptor, current_ordinal, descriptor_sm

    desc = capture_device_descriptor(current_ordinal())
    return (descriptor_sm(desc) if sm is None else sm), desc["deviceName"]


# ---------------------------------------------------------------------------------------- probing
def _resolve_device(device: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A catalog name or a descriptor, validated; ``None`` stays ``None`` (no descriptor: only
    a real handle can plan then)."""
    from ...descriptors import DescriptorError, load_descriptor, validate_descriptor

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
        return graph_result(**kw)

    try:
        cfg = _config(config)
    except (ValueError, TypeError) as exc:
        return done(code="cudnn.probe_error", step="mapping", message=f"invalid config: {exc}")
    try:
        desc = _resolve_device(device)
    except (ValueError, TypeError) as exc:
        return done(code="cudnn.bad_descriptor", step="device", message=str(exc))
    from ...descriptors import cudnn_json, descriptor_sm

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
        check_expressible(cfg)
    except Unsupported as exc:
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
    args = (cudnn, sm, int(st["version_int"]), graph_kw, build_plans, tuple(heuristics), spec)
    steps = cp_steps(cfg)
    if not steps:
        return done(**_probe_derived(cfg, *args), **base)
    return done(**_probe_cp(steps, args, spec), **base)


def _probe_derived(cfg: FusedAttnConfig, cudnn: Any, sm: int, version_int: int,
                   graph_kw: dict[str, Any], build_plans: bool, heuristics: tuple[str, ...],
                   spec: bool) -> dict[str, Any]:  # fmt: skip
    """TE's derived config of one (non-CP) query, its pre-graph refusal, then its forward (and
    backward) graph through cuDNN: the result's fields (:func:`graph_result`), less the base."""
    d = derive(cfg, sm, version_int)
    spec_out: dict[str, Any] = {}
    extra: dict[str, Any] = {"graph_spec": spec_out, "derived": d.to_dict()} if spec else {}
    refusal = te_refusal(cfg, d)
    if refusal is not None:
        return dict(
            decided=True,
            code="cudnn.te_refused",
            step="derive",
            message="TE 2.20.2 refuses before building a graph (nvte_get_fused_attn_backend_v2): "
            + refusal,
            summary=refusal,
            notes=list(d.notes),
            **extra,
        )
    try:
        check_fp8_expressible(cfg)
    except Unsupported as exc:
        return dict(code=exc.code, step="mapping", message=str(exc), **extra)
    notes = list(d.notes)
    io = io_dtype(cudnn, d)
    plans: dict[str, list[str]] = {}
    modes: dict[str, str] = {}
    graphs = ("fwd", "bwd") if cfg.is_training else ("fwd",)
    for which in graphs:
        outcome = _run_graph(cudnn, which, d, io, graph_kw, build_plans, heuristics, spec)
        if spec and outcome.get("spec") is not None:
            spec_out[which] = outcome["spec"]
        notes.extend(outcome.get("notes") or [])
        modes[which] = heuristics[0]
        if not outcome["ok"]:
            fail = dict(outcome["fail"])
            fail.pop("heur_mode", None)
            return dict(plans=plans, heur_mode=modes, graph=which, notes=notes, **fail, **extra)
        plans[which] = outcome["plans"]
    return dict(supported=True, decided=True, plans=plans, heur_mode=modes, notes=notes, **extra)


def _probe_cp(steps: tuple[CPStep, ...], args: tuple[Any, ...], spec: bool) -> dict[str, Any]:
    """Context parallelism as TE 2.20.2 queries it: one query per per-step config
    (:func:`.cp.cp_steps`), each with its own derived config and graphs. Every step is built
    and its verdict kept in ``cp_steps``; the verdict is the first step cuDNN (or TE's C++)
    refuses (TE disables FusedAttention there), else undecided where a step could not be asked,
    else supported. Plans and graph specs are keyed ``fwd[<step>]``, ``derived`` by step."""
    answers = [(s, _probe_derived(s.config, *args) if s.config is not None else dict(
        code="cudnn.unsupported_by_probe", step="mapping",
        message=f"no valid config for this step: {s.error}")) for s in steps]  # fmt: skip
    entries, plans, modes, graph_spec, derived = [], {}, {}, {}, {}
    notes: list[str] = []
    for s, r in answers:
        entries.append({**s.to_dict(), **{k: r.get(k) for k in ("code", "step", "graph",
                                                                 "summary")},
                        "supported": bool(r.get("supported")), "decided": bool(r.get("decided")),
                        "plans": r.get("plans") or {}})  # fmt: skip
        for which, names in (r.get("plans") or {}).items():
            plans[f"{which}[{s.label}]"] = names
        for which, mode in (r.get("heur_mode") or {}).items():
            modes[f"{which}[{s.label}]"] = mode
        for which, g in (r.get("graph_spec") or {}).items():
            graph_spec[f"{which}[{s.label}]"] = g
        if "derived" in r:
            derived[s.label] = r["derived"]
        for note in (*s.notes, *(r.get("notes") or ())):
            text = note if note in s.notes else f"[{s.label}] {note}"
            if text not in notes:
                notes.append(text)
    out: dict[str, Any] = {"cp_steps": entries, "plans": plans, "heur_mode": modes,
                           "notes": notes}  # fmt: skip
    if spec:
        out.update(graph_spec=graph_spec, derived=derived)
    hit = next(((s, r) for s, r in answers if r.get("decided") and not r.get("supported")), None)
    hit = hit or next(((s, r) for s, r in answers if not r.get("decided")), None)
    if hit is None:
        return {**out, "supported": True, "decided": True}
    s, r = hit
    fail = {k: r.get(k) for k in ("decided", "code", "step", "graph", "error_type")}
    for k in ("message", "summary"):
        if r.get(k):
            fail[k] = f"{s.describe()}: {r[k]}"
    return {**out, **fail, "supported": False, "cp_step": s.label}


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
        GraphBuilder(cudnn, g, d).build(which)
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
    "backend_handle",
    "backend_status",
    "probe_config",
    "summarize",
]

if __name__ == "__main__":  # pragma: no cover - manual check: python -m ...fused.graph h100
    import json

    print(
        json.dumps(
            probe_config(FusedAttnConfig(), sys.argv[1] if len(sys.argv) > 1 else "h100"), indent=2
        )
    )
