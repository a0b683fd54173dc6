"""Candidate probes: one room per backend (``fused/``, ``flash/``, ``triton``, ``unfused``), each a
rule stage followed by real probes."""

from __future__ import annotations

from .base import Probe


def default_probes(graph: bool = True) -> tuple[Probe, ...]:
    """The four candidates, in display order (fused, flash, triton, unfused). ``graph=False``
    keeps FusedAttention at its rule stage (no cuDNN graph builds)."""
    from .flash.probe import FlashAttnProbe
    from .fused.probe import CudnnProbe
    from .triton import TritonFlashProbe
    from .unfused import UnfusedProbe

    return (CudnnProbe(graph=graph), FlashAttnProbe(), TritonFlashProbe(), UnfusedProbe())


__all__ = ["Probe", "default_probes"]
