"""Per-call cost of selection: a memo hit vs a full rule pass (every candidate's rules).

Prints one line each, as a ratio against the full pass measured in the same run:
    select memo_hit_us=... full_rule_pass_us=... ratio=...
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from te_fl_attention import FusedAttnConfig, Policy, Selector  # noqa: E402
from te_fl_attention.device import profile  # noqa: E402
from te_fl_attention.presets import preset  # noqa: E402


def _median_us(fn, n: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    device, policy = profile("h100"), Policy()
    cfg = FusedAttnConfig(**preset("llama3-8b"))
    hot = Selector()
    hot.decide(cfg, device, policy)
    memo = _median_us(lambda: hot.decide(cfg, device, policy), 20000)

    def full():
        s = Selector()
        s.decide(cfg, device, policy)

    full_us = _median_us(full, 300)
    # What a TE forward pays on a repeated config: building the config from TE's parameters
    # plus the memo hit (the plugin path).
    rebuilt = _median_us(lambda: hot.decide(FusedAttnConfig(**preset("llama3-8b")), device,
                                            policy), 5000)  # fmt: skip
    env = _median_us(lambda: hot.decide(cfg, device, Policy.from_env()), 20000)
    print(f"select memo_hit_us={memo:.2f} full_rule_pass_us={full_us:.1f} "
          f"ratio={full_us / memo:.0f}x")
    print(f"select memo_hit_with_config_build_us={rebuilt:.2f} "
          f"memo_hit_with_env_policy_us={env:.2f} (vs full pass {full_us:.1f} us)")


if __name__ == "__main__":
    main()
