"""Candidate probes: one room per backend (``fused/``, ``flash/``, ``triton``, ``unfused``), each a
rule stage followed by real probes. Which probes exist is the registry's business
(:mod:`te_fl_attention.backends`)."""

from __future__ import annotations

from .. import backends
from .base import Probe


def default_probes(graph: bool = True, interpret: bool = False) -> tuple[Probe, ...]:
    """One probe per registered candidate, in display order (fused, flash, triton, unfused, then
    any registered since). ``graph=False`` keeps FusedAttention at its rule stage (no cuDNN graph
    builds); ``interpret`` lets the probes that can use the Triton interpreter on CPU."""
    return tuple(b.make_probe(graph=graph, interpret=interpret) for b in backends.all_backends())


__all__ = ["Probe", "default_probes"]
