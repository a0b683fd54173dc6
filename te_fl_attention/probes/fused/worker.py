"""Crash isolation for cuDNN probes: a long-lived worker subprocess, JSON lines over pipes.

cuDNN can abort the process it runs in (a missing cuBLAS is a ``SIGABRT``; a bad graph may be
worse), and the deviceless setup loads a stub ``libcuda.so.1`` that must never end up in the
caller's process. So probes run in a worker process that:

* is spawned lazily on the first probe and reused for the next ones (its import of cuDNN and its
  device-property cache make every later probe ~1-10 ms);
* sets up the driver (:func:`.stubcuda.setup_driver`: the stub only when no real driver is
  loadable), imports cudnn, and answers ``{"op": "probe", ...}`` requests with
  :func:`.graph.probe_config` results;
* keeps the protocol on a private copy of its stdout: its fd 1 is pointed at fd 2, so whatever
  C++ prints cannot corrupt a reply; its stderr goes to a temporary file, whose tail explains a
  death ("Invalid handle. Cannot load symbol ...").

Process management (spawn, timeouts, respawn, device narrowing) is :mod:`te_fl_attention.workers`.

A probe that crashes the worker, or runs past its timeout (the worker is then killed), becomes a
result ``{"supported": False, "decided": False, "step": "worker", "code": "cudnn.worker_died" |
"cudnn.worker_timeout", "message": "probe worker died (signal 6, SIGABRT) ..."}``; the next probe
starts a new worker transparently. A worker found dead between probes is replaced, and the probe
that notices it says so in its ``notes``.

On a machine with a GPU the worker sees the real driver (the stub is never loaded there).
``probe(..., use_real_gpu=True)`` then plans with a real cuDNN handle on the local GPU instead of
the descriptor it is sent; a worker that finds no real driver (the stub) plans deviceless with
that descriptor and says so in the result's ``notes`` (``mode`` stays ``"deviceless"``).

There is one worker per parent device (:func:`get_worker`): the worker for device ``N`` is spawned
with ``CUDA_VISIBLE_DEVICES`` narrowed to the parent's device ``N`` (:func:`visible_device`), so its
handle, created on its device 0, is the parent's device, and no context is opened on another GPU
(on an 8-GPU node each rank's worker stays on that rank's GPU). The real-handle path **never ran on
a GPU** (none was available while writing it; the test suite runs it with a fake handle).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from ...workers import (
    DEVICE_ENV,
    START_TIMEOUT_S,
    JsonWorker,
    WorkerFailure,
    WorkerPool,
    protocol_stdout,
    serve,
    visible_device,
    worker_env,
)

_STDERR_LIMIT = 1 << 20  # the worker truncates its stderr file past 1 MiB


def _worker_result(code: str, message: str, **kw: Any) -> dict[str, Any]:
    from .graph import graph_result

    return graph_result(
        supported=False,
        decided=False,
        code=code,
        step="worker",
        message=message,
        summary=message.splitlines()[0] if message else message,
        **kw,
    )


class CudnnWorker(JsonWorker):
    """One probe worker process (spawned on first use, respawned after a death); ``device``: the
    parent's CUDA device it is narrowed to (``None``: not narrowed, for deviceless questions).

    Thread-safe: probes are serialized. ``close()`` ends the worker; the object stays usable
    (the next probe spawns a new one).
    """

    def __init__(self, *, start_timeout_s: float = START_TIMEOUT_S,
                 env: Mapping[str, str] | None = None,
                 device: int | None = None) -> None:  # fmt: skip
        super().__init__("te_fl_attention.probes.fused.worker", env=env, device=device,
                         name="probe worker", job="probe", start_timeout_s=start_timeout_s)

    def request(self, payload: Mapping[str, Any], timeout_s: float  # type: ignore[override]
                ) -> dict[str, Any]:  # fmt: skip
        """Send one request and wait for its reply (a worker-failure result on death/timeout)."""
        try:
            reply, notes = super().request(payload, timeout_s)
        except WorkerFailure as exc:
            code = "cudnn.worker_timeout" if exc.kind == "timeout" else "cudnn.worker_died"
            return _worker_result(code, str(exc), notes=exc.notes)
        result = reply.get("result", reply)
        if notes and isinstance(result, dict):
            result["notes"] = notes + list(result.get("notes") or [])
        return result

    def probe(
        self,
        config_dict: Mapping[str, Any],
        device_descriptor: str | Mapping[str, Any] | None,
        sm: int | None = None,
        timeout_s: float = 30.0,
        *,
        build_plans: bool = False,
        heuristics: tuple[str, ...] | None = None,
        use_real_gpu: bool = False,
        spec: bool = False,
    ) -> dict[str, Any]:
        """:func:`.graph.probe_config` in the worker; see the module doc for failures.

        ``device_descriptor``: a descriptor dict, a catalog name (resolved here, so a bad name
        fails fast without a worker), or ``None`` with ``use_real_gpu`` (the worker's device
        describes itself). ``use_real_gpu``: plan on the worker's GPU with a real handle (only
        where the worker found a real driver with a GPU; elsewhere the descriptor answers,
        deviceless; the real path never ran on a GPU). ``spec``: also return the graphs'
        cudnn-frontend JSON (``graph_spec``) and TE's derived config (``derived``), see
        :func:`.graph.probe_config`. Never raises for a bad descriptor: the result says
        ``cudnn.bad_descriptor``.
        """
        from ...descriptors import DescriptorError, load_descriptor
        from .graph import graph_result

        if isinstance(device_descriptor, str):
            try:
                device_descriptor = load_descriptor(device_descriptor)
            except DescriptorError as exc:
                return graph_result(code="cudnn.bad_descriptor", step="device", message=str(exc))
        if device_descriptor is None:
            device = None
        elif isinstance(device_descriptor, Mapping):
            device = {k: v for k, v in device_descriptor.items() if k != "_sources"}
        else:
            return graph_result(code="cudnn.bad_descriptor", step="device",
                           message="a device descriptor is a JSON object or a catalog name, got "
                           f"{type(device_descriptor).__name__}")  # fmt: skip
        unnamed = None
        if use_real_gpu and self.device is not None:  # gpu-only
            parent = self.base_env.get("CUDA_VISIBLE_DEVICES")
            if visible_device(self.device, parent) is None:
                use_real_gpu = False
                unnamed = (f"the parent's device {self.device} has no entry in its "
                           f"CUDA_VISIBLE_DEVICES={parent!r}: the worker cannot be narrowed to "
                           "it, so it planned deviceless with the descriptor")  # fmt: skip
        payload: dict[str, Any] = {
            "op": "probe",
            "config": dict(config_dict),
            "device": device,
            "sm": sm,
            "build_plans": build_plans,
            "use_real_gpu": use_real_gpu,
        }
        if spec:
            payload["spec"] = True
        if heuristics is not None:
            payload["heuristics"] = list(heuristics)
        try:
            json.dumps(payload)
        except (TypeError, ValueError) as exc:
            return graph_result(code="cudnn.bad_descriptor", step="device",
                           message=f"the request is not plain JSON: {exc}")  # fmt: skip
        result = self.request(payload, timeout_s)
        if unnamed is not None:  # gpu-only
            result["notes"] = [unnamed, *(result.get("notes") or [])]
        return result


__all__ = ["CudnnWorker", "START_TIMEOUT_S", "close_workers", "get_worker", "visible_device",
           "worker_env"]

_POOL = WorkerPool(lambda device: CudnnWorker(device=device))


def get_worker(device: int | None = None) -> CudnnWorker:
    """The process-wide worker for the parent's CUDA device ``device`` (created on first use,
    closed at exit): narrowed to that device by ``CUDA_VISIBLE_DEVICES``. ``None``: the worker for
    deviceless questions (catalog GPUs), not narrowed, which never creates a handle."""
    return _POOL.get(device)


def close_workers() -> None:
    """Stop every worker :func:`get_worker` started (they respawn on the next probe)."""
    _POOL.close_all()


# ---------------------------------------------------------------------------------------- worker
def _scan_stderr(offset: int) -> tuple[int, list[str]]:
    """New "Could not load symbol X" lines on our stderr since ``offset`` (it is a file)."""
    try:
        size = os.fstat(2).st_size
    except OSError:
        return offset, []
    if size < offset:
        offset = 0
    if size == offset:
        return offset, []
    try:
        data = os.pread(2, min(size - offset, _STDERR_LIMIT), offset)
    except OSError:
        return size, []
    missing = []
    for ln in data.decode("utf-8", "replace").splitlines():
        if "Could not load symbol" in ln:
            name = ln.split("Could not load symbol", 1)[1].split(".")[0].strip()
            if name and name not in missing:
                missing.append(name)
    if size > _STDERR_LIMIT:
        with contextlib.suppress(OSError):
            os.ftruncate(2, 0)
        size = 0
    return size, missing


def _serve() -> int:  # runs in the worker subprocess (measured there by gpu_branches.py)
    out = protocol_stdout()

    from . import graph, stubcuda

    st = graph.backend_status()
    setup = stubcuda.current_setup()
    hello = {
        "pid": os.getpid(),
        "ok": st["ok"],
        "error": st["error"],
        "driver": st["driver"],
        "stub_path": setup.path if setup and setup.mode == "stub" else None,
        "cudnn_version": st["cudnn_version"],
        "frontend_version": st["frontend_version"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "parent_device": os.environ.get(DEVICE_ENV),
    }
    offset = _scan_stderr(0)[0]

    def handle(op: str, req: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        nonlocal offset
        if op == "sleep":  # a test aid: a probe that takes a while (crash/timeout tests)
            time.sleep(float(req.get("seconds", 0)))
            return {"result": {"slept": req.get("seconds")}}, False
        if op != "probe":
            return {"error": f"unknown op {op!r}"}, False
        try:
            result = graph.probe_config(
                req["config"],
                req.get("device"),
                req.get("sm"),
                build_plans=bool(req.get("build_plans")),
                heuristics=tuple(req.get("heuristics") or graph.HEURISTICS),
                use_real_gpu=bool(req.get("use_real_gpu")),
                spec=bool(req.get("spec")),
            )
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            result = graph.graph_result(
                code="cudnn.probe_error", step="mapping", message=f"{type(exc).__name__}: {exc}"
            )
        offset, missing = _scan_stderr(offset)
        if missing:
            result["notes"] = list(result.get("notes") or []) + [
                "the stub driver lacks symbol(s) cuDNN asked for: " + ", ".join(missing)
            ]
            if not result.get("supported"):
                result["decided"] = False
                result["code"] = "cudnn.stub_incomplete"
        return {"result": result}, False

    return serve(out, hello, handle)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_serve())
