"""Warm start: selecting for >= 200 configs in a fresh process, cold (probing) vs warm (store).

Each phase runs in its own fresh process against one SQLite store: the cold phase probes every
config (cuDNN graph builds when cudnn-frontend is installed, rules otherwise) and writes the
results; the warm phase answers the same configs from the store. The warm phase lasts some 20 ms,
so a moment of noise on a shared machine can double it: it runs ``--warm-runs`` times (default
5), each in a fresh process, and the line gives the medians over the runs (``warm_ms``,
``ratio``, ``first_warm_lookup_us``, each taken on its own) with the slowest beside them
(``ratio_min``, ``first_warm_lookup_max_us``). Prints one line:
    warmstart configs=N cold_ms=... warm_ms=... ratio=...x first_warm_lookup_us=... ...
``--no-orjson``: both phases with the standard json module only (as without orjson installed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def configs() -> list[dict]:
    """TE-like attention test shapes x masks x two dtypes x training/inference (>= 200)."""
    out = []
    seqs = [(128, 128), (2048, 2048), (1, 2048), (2048, 4096)]
    heads = [(16, 16), (24, 4), (16, 1)]
    dims = [(64, 64), (128, 128), (256, 256), (192, 128)]
    for (sq, skv), (h, hg), (dqk, dv), mask, dtype, train in itertools.product(
        seqs, heads, dims, ("no_mask", "causal_bottom_right"), ("bf16", "fp16"), (True, False)
    ):
        out.append(dict(batch_size=2, max_seqlen_q=sq, max_seqlen_kv=skv, num_heads=h,
                        num_gqa_groups=hg, head_dim_qk=dqk, head_dim_v=dv, dtype=dtype,
                        attn_mask_type=mask, is_training=train))  # fmt: skip
    return out


PHASE = r"""
import json, os, sys, time
t0 = time.perf_counter()
from te_fl_attention import FusedAttnConfig
if os.environ.get("BENCH_NO_ORJSON"):  # --no-orjson: as without orjson installed
    from te_fl_attention.cache import _json
    _json.FAST = False
from te_fl_attention.selector import default_selector
from te_fl_attention.device import profile
cfgs = [FusedAttnConfig(**c) for c in json.load(open(sys.argv[1]))]
dev = profile("h100")
sel = default_selector()
sel.prepare(dev)                     # start-up: open the store, compute key parts
t_open = time.perf_counter()
first = None
for c in cfgs:
    t = time.perf_counter()
    sel.decide(c, dev)
    if first is None:
        first = time.perf_counter() - t
t_end = time.perf_counter()
print(json.dumps({"total_s": t_end - t_open, "first_s": first, "startup_s": t_open - t0,
                  "stats": sel.stats}))
"""


def run_phase(cfg_file: str, store: str, no_orjson: bool = False) -> dict:
    env = {**os.environ, "TE_FL_ATTN_CACHE": store, "PYTHONPATH": str(ROOT)}
    if no_orjson:
        env["BENCH_NO_ORJSON"] = "1"
    p = subprocess.run([sys.executable, "-c", PHASE, cfg_file], capture_output=True, text=True,
                       env=env, check=True)  # fmt: skip
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-runs", type=int, default=5, help="warm processes (default 5)")
    ap.add_argument("--no-orjson", action="store_true", help="the standard json module only")
    args = ap.parse_args()
    if args.warm_runs < 1:
        ap.error(f"--warm-runs must be at least 1 (got {args.warm_runs})")
    cfgs = configs()
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = os.path.join(tmp, "configs.json")
        with open(cfg_file, "w") as fh:
            json.dump(cfgs, fh)
        store = os.path.join(tmp, "probes.sqlite")
        cold = run_phase(cfg_file, store, args.no_orjson)
        runs = [run_phase(cfg_file, store, args.no_orjson) for _ in range(args.warm_runs)]
    for warm in runs:
        assert warm["stats"]["probes"] == 0, warm["stats"]
    totals = [w["total_s"] for w in runs]
    firsts = [w["first_s"] for w in runs]
    warm_s, first_s = statistics.median(totals), statistics.median(firsts)
    startup_s = statistics.median(w["startup_s"] for w in runs)
    print(
        f"warmstart configs={len(cfgs)} cold_ms={cold['total_s'] * 1e3:.0f} "
        f"warm_ms={warm_s * 1e3:.1f} ratio={cold['total_s'] / warm_s:.0f}x "
        f"first_warm_lookup_us={first_s * 1e6:.0f} "
        f"cold_per_config_ms={cold['total_s'] * 1e3 / len(cfgs):.2f} "
        f"warm_per_config_us={warm_s * 1e6 / len(cfgs):.0f} "
        f"warm_runs={len(runs)} ratio_min={cold['total_s'] / max(totals):.0f}x "
        f"first_warm_lookup_max_us={max(firsts) * 1e6:.0f} "
        f"probes_cold={cold['stats']['probes']} warm_startup_ms={startup_s * 1e3:.0f} "
        f"{'json-only ' if args.no_orjson else ''}"
        "(targets: ratio >= 100x, first warm lookup <= 100 us)"
    )


if __name__ == "__main__":
    main()
