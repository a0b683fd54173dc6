"""Test-only, GPU only: a tiny-run worker setup module (``RunWorker(setup="gpu_faults")``) whose
``triton`` runner launches a real Triton kernel that stores far out of bounds, then returns the
reference's answer: on a GPU that is an asynchronous illegal address, which the worker must report
as this run's failure without harming the caller."""

from __future__ import annotations

import triton
import triton.language as tl

from te_fl_attention.kernels import run as runner


@triton.jit
def _store_far(ptr):
    tl.store(ptr + (1 << 40), 1.0)


def _faulting(q, k, v, f):
    _store_far[(1,)](q)
    return runner.RUNNERS["unfused"](q, k, v, f)


runner.RUNNERS["triton"] = _faulting
