"""The tiny-run worker's side (``python -m te_fl_attention.run_worker_serve``): it answers
:class:`te_fl_attention.run_worker.RunWorker`'s requests with
:func:`~te_fl_attention.problems.tiny_run_here` (see :mod:`te_fl_attention.run_worker`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from .workers import protocol_stdout
from .workers import serve as serve_requests

__all__ = ["serve"]


# ---------------------------------------------------------------------------------------- worker
def _error_dict(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)[:4000],
            "modules": sorted({c.__module__ for c in type(exc).__mro__})}  # fmt: skip


def serve(argv: Sequence[str] = ()) -> int:
    """The worker's loop (``python -m te_fl_attention.run_worker_serve [--setup MODULE]``)."""
    out = protocol_stdout()  # whatever a kernel prints goes to stderr, never into a reply
    args = list(argv)
    if "--setup" in args:
        import importlib

        importlib.import_module(args[args.index("--setup") + 1])
    import torch

    from . import problems
    from .config import FusedAttnConfig

    hello: dict[str, Any] = {"pid": os.getpid(), "cuda": torch.cuda.is_available(),
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def handle(op: str, req: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if op != "tiny_run":
            return {"error": f"unknown op {op!r}"}, False
        try:
            config = FusedAttnConfig.from_dict(req["config"])
            note, exc = problems.tiny_run_here(req["backend"], config)
        except Exception as bad:  # noqa: BLE001 - a bad request: report, keep serving
            note, exc = None, bad
        # after a failed run on a GPU the context may be poisoned: reply, then leave
        restart = exc is not None and torch.cuda.is_available()
        result = {"note": note, "error": _error_dict(exc) if exc is not None else None}
        return {"result": result, "restart": restart}, restart

    return serve_requests(out, hello, handle)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
