"""Helpers for the fleet tests: sample configs, a real-GPU profile, child-process environments and
multi-rank launches."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

from te_fl_attention import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.presets import preset

HERE = Path(__file__).resolve().parent

LLAMA = FusedAttnConfig(**preset("llama3-8b"))
SWA = FusedAttnConfig(**preset("gpt-oss-120b-swa"))
FP32 = FusedAttnConfig(dtype="fp32", num_heads=8)


def real_gpu(name="NVIDIA H100 80GB HBM3", base="h100", memory=79.1, **versions):
    dev = profile(base).with_overrides(versions) if versions else profile(base)
    return dataclasses.replace(dev, name=name, source="local", memory_gib=memory)


def run_ranks(args_for, world: int, timeout: float, env: dict[str, str] | None = None
              ) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """Start ``world`` Python processes (``args_for(rank)`` after ``python``), wait for all of
    them; kill them all and fail if they outlast ``timeout`` (a deadlock fails, never hangs)."""
    procs = [subprocess.Popen([sys.executable, *args_for(r)], env=env or child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail(f"ranks did not finish within {timeout:.0f} s (deadlock?)")
    for r, done in enumerate(outs):
        assert done.returncode == 0, f"rank {r} failed:\n{done.stdout[-4000:]}"
    return outs
