"""Isolated GPU runs: a long-lived worker process that runs the probes' tiny runs.

A kernel that faults (an illegal address, a device-side assert) reports it asynchronously, at the
next synchronizing call, and a sticky fault leaves the CUDA context unusable: in-process, the
fault would surface in the *next* candidate and poison the caller (TE's training process, when the
plugin probes). So on a GPU :func:`te_fl_attention.problems.tiny_run` sends each run here:

* the worker is spawned lazily on the first run and reused (one CUDA context, warm imports), one
  per caller device: ``CUDA_VISIBLE_DEVICES`` is narrowed to the caller's current device
  (:func:`te_fl_attention.workers.worker_env`), and a caller that switched devices is served by
  that device's worker;
* it answers JSON lines over pipes (``{"op": "tiny_run", "backend": ..., "config": {...}}``) with
  :func:`~te_fl_attention.problems.tiny_run_here`, which synchronizes after the run, so a fault is
  reported as the failure of the candidate that ran (stage ``run``); after a failed run the worker
  exits and the next run starts a fresh one (its context may be poisoned);
* a run that kills the worker or runs past its timeout (the worker is then killed) becomes that
  candidate's error (:class:`RunFailure` ``WorkerDied`` / ``WorkerTimeout``, with the tail of
  the worker's stderr); the next run starts a new worker. A worker that cannot start at all is
  nobody's fault: the run is skipped with a note (the candidate keeps its earlier verdict).

This module is the caller's side; the worker's loop is :mod:`te_fl_attention.run_worker_serve`
(it imports :mod:`te_fl_attention.problems`, which imports this module). Process management
(spawn, timeouts, respawn, device narrowing) is :class:`te_fl_attention.workers.JsonWorker`,
shared with the cuDNN probe worker. The worker's GPU
path never ran on a GPU (tested on CPU through ``tests/fakegpu``, whose ``sitecustomize`` presents
a GPU in the worker).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .workers import START_TIMEOUT_S, JsonWorker, WorkerFailure, WorkerPool, current_device

if TYPE_CHECKING:
    from .config import FusedAttnConfig

#: The worker's side (``python -m``): :mod:`te_fl_attention.run_worker_serve`.
MODULE = "te_fl_attention.run_worker_serve"


class RunFailure(RuntimeError):
    """A run's failure reported by the worker: ``type_name`` is the original exception's type
    (``RuntimeError``...; ``WorkerDied`` / ``WorkerTimeout`` when the worker itself failed),
    ``modules`` the modules of its classes (a Triton compiler error is told by them)."""

    def __init__(self, type_name: str, message: str, modules: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.modules = tuple(modules)


# ------------------------------------------------------------------------------ tiny-run worker
class RunWorker(JsonWorker):
    """The tiny-run worker (see the module doc). ``setup``: a module the worker imports at start
    (a test aid: it may put kernels into :data:`~te_fl_attention.kernels.run.RUNNERS`)."""

    def __init__(self, *, env: Mapping[str, str] | None = None, setup: str | None = None,
                 device: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:  # fmt: skip
        super().__init__(MODULE, ("--setup", setup) if setup else (), env=env, device=device,
                         name="tiny-run worker", job="run",
                         start_timeout_s=start_timeout_s)  # fmt: skip

    def tiny_run(self, backend: str, config: FusedAttnConfig, timeout_s: float
                 ) -> tuple[str | None, Exception | None]:  # fmt: skip
        """:func:`~te_fl_attention.problems.tiny_run_here` in the worker: ``(note, error)``."""
        with self._lock:
            payload = {"op": "tiny_run", "backend": backend, "config": config.to_dict()}
            try:
                reply, _ = self.request(payload, timeout_s)
            except WorkerFailure as exc:
                if exc.kind == "start":  # nothing ran: not the candidate's failure
                    return f"tiny run not run: {exc}", None
                kind = "WorkerTimeout" if exc.kind == "timeout" else "WorkerDied"
                return None, RunFailure(kind, f"{exc} (tiny run of {backend})")
            if reply.get("restart"):
                self.close()  # it failed a run: its CUDA context may be poisoned
            if "error" in reply and "result" not in reply:
                return None, RunFailure("WorkerError", str(reply["error"]))
            result = reply["result"]
            err = result.get("error")
            if err:
                return result.get("note"), RunFailure(err["type"], err["message"],
                                                      err.get("modules", ()))  # fmt: skip
            return result.get("note"), None


__all__ = ["RunFailure", "RunWorker", "get_worker"]

_POOL = WorkerPool(lambda device: RunWorker(device=device))


def get_worker(device: int | None = None) -> RunWorker:
    """The process-wide tiny-run worker for this process's current CUDA device (or ``device``),
    created on first use, closed at exit."""
    return _POOL.get(current_device() if device is None else device)
