"""Regret of the rule-priority choice against measured mode, over >= 30 configs on the local GPU.

GPU only. NOTE: this script has never run on a GPU (it was written on a CPU-only machine); without
CUDA it prints one "skipped" line and exits 0 (on CPU measured mode times scaled-down shapes and
only the reference and the Triton interpreter can run: no regret worth printing).

For every config (Llama-3-style GQA and MHA head layouts x sequence lengths x masks x
training/inference, plus MLA, sliding-window, fp16, bshd, d64 and deterministic cases) the
selector decides twice on the local device: with TE's rule priority (``Policy()``) and in
measured mode (``Policy(measure=True)``: each supported candidate that can run here, flash-attn
flavours separately, is timed on the real shape; the fastest wins). The regret of a config is
``time(rule choice) / time(measured choice) - 1`` with the measured timings
(fwd+bwd for training, fwd for inference). Prints one line:

    measured_regret gpu=... configs=N differ=K regret_mean=..% regret_max=..% (worst: ...) untimed=U

``untimed`` counts configs whose rule choice could not be timed (the runner cannot express it:
e.g. ``fused`` runs through torch SDPA's cuDNN backend, which takes no sliding window).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from te_fl_attention import FusedAttnConfig, Policy, Selector  # noqa: E402
from te_fl_attention.cache import MemoryCache  # noqa: E402
from te_fl_attention.measure import metric  # noqa: E402
from te_fl_attention.presets import preset  # noqa: E402


def configs() -> list[FusedAttnConfig]:
    """>= 30 distinct configs: 3 head layouts x 2 lengths x 2 masks x train/infer, + 6 special."""
    heads = ({}, {"num_heads": 64}, {"num_heads": 16, "num_gqa_groups": 16})  # 32/8, 64/8, MHA
    out = []
    for extra, seqlen, mask, training in itertools.product(
        heads, (1024, 4096), ("causal", "no_mask"), (True, False)
    ):  # fmt: skip
        kw = {**preset("llama3-8b", seqlen=seqlen, batch=2), **extra, "attn_mask_type": mask}
        out.append(FusedAttnConfig(**kw, is_training=training))
    special = [
        dict(preset("deepseek-v3", seqlen=2048)),
        dict(preset("llama3-8b", seqlen=4096), window_size=(512, 0)),
        dict(preset("llama3-8b", seqlen=2048), dtype="fp16"),
        dict(preset("llama3-8b", seqlen=2048), qkv_layout="bshd_bshd_bshd"),
        dict(preset("llama3-8b", seqlen=2048), head_dim_qk=64, num_heads=64),
        dict(preset("llama3-8b", seqlen=2048), deterministic=True),
    ]
    return out + [FusedAttnConfig(**kw) for kw in special]


def unit(decision) -> str | None:
    """The backend that runs: the flash flavour when flash is chosen."""
    return decision.flash_variant or decision.chosen


def main() -> int:
    if not torch.cuda.is_available():
        print("measured_regret skipped: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 0
    sel = Selector(cache=MemoryCache())
    regrets, differ, untimed, worst = [], 0, 0, ("-", 0.0)
    for c in configs():
        rule = sel.decide(c, "local", Policy())
        measured = sel.decide(c, "local", Policy(measure=True))
        timings = measured.detail.get("timings_ms") or {}
        a, b = unit(rule), unit(measured)
        differ += a != b
        m = metric(c)
        if a not in timings or b not in timings:
            untimed += 1
            continue
        regret = timings[a][m] / timings[b][m] - 1.0
        regrets.append(regret)
        if regret > worst[1]:
            worst = (f"{c.num_heads}h d{c.head_dim_qk} s{c.max_seqlen_q} {c.attn_mask_type} "
                     f"{m}: {a} vs {b}", regret)  # fmt: skip
    mean = statistics.mean(regrets) if regrets else 0.0
    print(f"measured_regret gpu={torch.cuda.get_device_name()} configs={len(configs())} "
          f"differ={differ} regret_mean={mean:.1%} regret_max={worst[1]:.1%} "
          f"(worst: {worst[0]}) untimed={untimed}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
