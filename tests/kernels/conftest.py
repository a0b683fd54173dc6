"""Kernel tests run on CPU through the Triton interpreter (set before triton is imported)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def gpu_launches(fake_gpu, monkeypatch):
    """The Triton kernel's GPU branch on CPU: an H100 presented by ``fake_gpu`` and every JIT
    kernel replaced by a launch double (``launch_double.py``) that records the launch and runs
    the kernel in the interpreter. Yields the :class:`~launch_double.LaunchLog`."""
    from launch_double import installed

    with installed(monkeypatch) as log:
        log.gpu = fake_gpu  # type: ignore[attr-defined]
        yield log
