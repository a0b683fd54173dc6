"""Decisions replayed from results probed elsewhere (another rank, another machine)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..config import FusedAttnConfig
from ..decide import decide
from ..device import DeviceProfile
from ..policy import Policy
from ..probes import Probe
from ..reasons import Decision, ProbeResult
from ..selector import narrow


def replay(config: FusedAttnConfig, device: DeviceProfile, recorded: Iterable[ProbeResult],
           probes: Sequence[Probe], policy: Policy) -> Decision:  # fmt: skip
    """The decision from ``recorded`` results (one per probe), through the same pure
    :func:`~te_fl_attention.decide.decide` the selector uses, each result first held to this
    process's own rule stage (a recorded result may only refuse more, see
    :func:`.selector.narrow`). ``LookupError`` when a probe has no usable recorded result."""
    by_name = {r.backend: r for r in recorded}
    results = []
    for p in probes:
        got = by_name.get(p.name)
        held = narrow(p, got, config, device) if got is not None else None
        if held is None:
            raise LookupError(f"no recorded {p.name} result for this config")
        results.append(held)
    return decide(config, device, results, policy, source="cache")
