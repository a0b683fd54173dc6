"""How long does asking cuDNN take? Deviceless SDPA graph probes through the worker process.

Prints one line::

    cudnn_probe configs=120 first_ms=... median_ms=... p90_ms=... supported=.../120
        train_ok_median_ms=... infer_ok_median_ms=... (target median <= 5 ms)

``first_ms``: a cold worker (process start, stub driver, ``import cudnn``) plus its first probe.
``median_ms`` / ``p90_ms``: round trips of a warm worker over distinct configs (every config is
probed once; there is no result cache). The mix is half training and half inference, over head
dims, masks, layouts, GQA, dtypes, sequence lengths and devices (h100, a100, b200).
``train_ok_median_ms`` / ``infer_ok_median_ms``: the same over the supported training configs
(forward and backward graphs planned) and the supported inference configs (forward only).

Run: ``python benchmarks/bench_cudnn_probe.py [--configs N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from te_fl_attention.config import FusedAttnConfig  # noqa: E402
from te_fl_attention.probes.fused.worker import CudnnWorker  # noqa: E402


def configs(n: int, seed: int = 0) -> list[tuple[FusedAttnConfig, str]]:
    """``n`` distinct (config, device) pairs in a fixed pseudo-random order."""
    space = itertools.product(
        (64, 96, 128, 192, 256),  # head dim
        ("causal", "no_mask", "padding", "padding_causal"),
        ("bshd_bshd_bshd", "sbhd_sbhd_sbhd", "bs3hd", "thd_thd_thd"),
        (16, 4),  # GQA groups (of 16 heads)
        ("bf16", "fp16"),
        (True, False),  # training
        ("h100", "a100", "b200"),
        (512, 2048),  # sequence length
    )
    out, seen = [], set()
    items = list(space)
    random.Random(seed).shuffle(items)
    for d, mask, layout, groups, dtype, train, dev, seq in items:
        if "3" in layout and groups != 16:
            continue
        if layout.startswith("thd") and "padding" not in mask:
            continue
        cfg = FusedAttnConfig(
            batch_size=2,
            num_heads=16,
            num_gqa_groups=groups,
            max_seqlen_q=seq,
            head_dim_qk=d,
            dtype=dtype,
            qkv_layout=layout,
            attn_mask_type=mask,
            is_training=train,
        )
        key = (cfg.key(), dev)
        if key in seen:
            continue
        seen.add(key)
        out.append((cfg, dev))
        if len(out) == n:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    todo = configs(args.configs, args.seed)

    with CudnnWorker() as worker:
        first_cfg, first_dev = todo[0]
        t0 = time.perf_counter()
        first = worker.probe(first_cfg.to_dict(), first_dev)
        first_ms = (time.perf_counter() - t0) * 1e3
        if not first["decided"]:
            print(f"cudnn_probe unavailable: {first['message']}")
            return 1
        times, supported, by_kind = [], 0, {"train": [], "infer": []}
        for cfg, dev in todo[1:]:
            t = time.perf_counter()
            r = worker.probe(cfg.to_dict(), dev)
            ms = (time.perf_counter() - t) * 1e3
            times.append(ms)
            supported += bool(r["supported"])
            if r["supported"]:  # both graphs built and planned (training) vs forward only
                by_kind["train" if cfg.is_training else "infer"].append(ms)
    times.sort()
    median = statistics.median(times)
    p90 = times[int(0.9 * (len(times) - 1))]
    print(
        f"cudnn_probe configs={len(todo)} first_ms={first_ms:.0f} median_ms={median:.2f} "
        f"p90_ms={p90:.2f} supported={supported + bool(first['supported'])}/{len(todo)} "
        f"train_ok_median_ms={statistics.median(by_kind['train'] or [0]):.2f} "
        f"infer_ok_median_ms={statistics.median(by_kind['infer'] or [0]):.2f} "
        "(target median <= 5 ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
