"""Test-only kernels for the tiny-run worker (``RunWorker(setup="run_worker_helpers")``): imported
by the worker process at start, they replace two runners there: ``fa2`` kills the worker
(``os._exit(3)``, as a crashing kernel would), ``triton`` hangs (a run past its timeout)."""

from __future__ import annotations

import os
import time

from te_fl_attention.kernels import run as runner


def _die(q, k, v, f):
    os._exit(3)


def _hang(q, k, v, f):
    time.sleep(600)


runner.RUNNERS["fa2"] = _die
runner.RUNNERS["triton"] = _hang
