"""The last hardware call of our Triton kernel, replaced: a launch double for the JIT kernels.

``kernel[grid](*args, **meta)`` on a GPU compiles and launches. :class:`LaunchDouble` stands in
for the kernel object: it records every launch (grid, constexprs, launch options), refuses a grid
CUDA would refuse (x up to 2^31 - 1, y and z up to 65,535: ``cuLaunchKernel`` answers
``invalid argument``), and then runs the *same* kernel function in Triton's interpreter with the
GPU's tile, forcing the fp32 upcast the interpreter needs for 16-bit dots (it multiplies raw bf16
bit patterns). So the GPU branch of :mod:`te_fl_attention.kernels.triton_flash` (tuning,
``torch.cuda.device``, the compiled launch, grid folding) runs on CPU and its outputs are still
checked against the reference.

Timing goes through ``torch.cuda.Event``; :class:`VirtualClock` (optional) replaces it with a
clock that only the doubles advance, by a cost model of the launch, so a tuning decision is
deterministic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: CUDA's grid limits (x, y, z).
GRID_LIMITS = (2**31 - 1, 65535, 65535)
#: Launch options a compiled launch takes and the interpreter has no use for.
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    meta: dict[str, Any]

    @property
    def config(self) -> tuple[int, int, int, int] | None:
        m = self.meta
        if "num_stages" not in m or "BLOCK_N" not in m:  # the interpreter's / a fixed tile
            return None
        return m.get("BLOCK_M"), m.get("BLOCK_N"), m["num_warps"], m["num_stages"]


@dataclass
class LaunchLog:
    launches: list[Launch] = field(default_factory=list)
    #: When False the doubles record and check grids but run nothing (huge grids).
    execute: bool = True
    #: ``cost(launch) -> ms`` advances the :class:`VirtualClock` (None: no virtual time).
    cost: Callable[[Launch], float] | None = None
    #: ``refuse(launch) -> exception or None``: a launch the device cannot take.
    refuse: Callable[[Launch], BaseException | None] | None = None
    clock: VirtualClock | None = None

    def of(self, kernel: str) -> list[Launch]:
        return [x for x in self.launches if x.kernel == kernel]


class VirtualClock:
    """Time that passes only when a launch double runs (by its cost model)."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def event_class(self) -> type:
        clock = self

        class ClockEvent:
            def __init__(self, enable_timing: bool = False, **_: Any) -> None:
                self.t: float | None = None

            def record(self, stream: Any = None) -> None:
                self.t = clock.now_ms

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end: ClockEvent) -> float:
                assert self.t is not None and end.t is not None
                return end.t - self.t

        return ClockEvent


class LaunchDouble:
    """Stands in for one JIT kernel (``name``) and logs to ``log``."""

    def __init__(self, name: str, kernel: Any, log: LaunchLog) -> None:
        self.name = name
        self.kernel = kernel
        self.log = log

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **meta: Any) -> None:
            g = tuple(grid(meta) if callable(grid) else grid)
            g3 = (*g, *(1,) * (3 - len(g)))
            rec = Launch(self.name, g3, dict(meta))  # type: ignore[arg-type]
            self.log.launches.append(rec)
            for n, limit in zip(g3, GRID_LIMITS, strict=True):
                if not 0 <= n <= limit:
                    raise RuntimeError(f"Triton Error [CUDA]: invalid argument (grid {g3})")
            refused = self.log.refuse(rec) if self.log.refuse else None
            if refused is not None:
                raise refused
            if self.log.clock is not None and self.log.cost is not None:
                self.log.clock.now_ms += self.log.cost(rec)
            if not self.log.execute:
                return
            kw = {k: v for k, v in meta.items() if k not in OPTIONS}
            if "UPCAST" in kw:  # the interpreter needs fp32 operands for 16-bit dots
                kw.update(UPCAST=True, DOT_PREC="ieee")
            self.kernel[g](*args, **kw)

        return launch


@contextlib.contextmanager
def installed(monkeypatch: Any, log: LaunchLog | None = None) -> Iterator[LaunchLog]:
    """Swap every JIT kernel of triton_flash for a double, make the module take its GPU branch
    and give it a fresh tuner (1 timed launch per candidate, no warm-up)."""
    from te_fl_attention.kernels import triton_flash as tf
    from te_fl_attention.kernels import tuning

    log = log if log is not None else LaunchLog()
    monkeypatch.setattr(tf, "interpreting", lambda: False)
    for name, attr in tf._KERNELS.items():
        monkeypatch.setattr(tf, attr, LaunchDouble(name, getattr(tf, attr), log))
    monkeypatch.setattr(tuning, "_TUNER", tuning.Tuner(warmup=0, reps=1))
    if log.clock is not None:
        import torch

        monkeypatch.setattr(torch.cuda, "Event", log.clock.event_class())
    yield log


class _Permanent:
    """``monkeypatch.setattr`` without undo (child processes)."""

    @staticmethod
    def setattr(obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)


def install_forever(log: LaunchLog | None = None) -> LaunchLog:
    """:func:`installed` for the rest of this process (child processes of tests)."""
    with installed(_Permanent(), log) as got:
        return got
