"""Agreement in a mixed job: one prober per device type vs every rank probing on its own.

Two fresh 8-process gloo jobs (ranks alternate between two simulated device types, a100 and
h100; every rank has its own empty cache) select the same >= 50 configs:

* ``agree``: ``te_fl_attention.fleet.agree(mode="local")``: the lowest rank of each type
  probes, the results are exchanged (two all_gather_object calls);
* ``alone``: every rank probes every config itself, as without agreement.

Wall time is the slowest rank's, from a barrier after the group is up to its last decision.
Prints one line:
    fleet ranks=8 types=2 configs=N probes agree=... alone=... wall_s agree=... alone=... ratio=...x
(``probes``: (config, device type) pairs probed, summed over ranks: the target is configs x
types for agree.)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ("a100", "h100")


def configs(n: int) -> list[dict]:
    """``n`` training shapes: head dims x masks x GQA x sequence lengths x dtypes."""
    grid = itertools.product((64, 96, 128, 192, 256), ("no_mask", "causal", "padding_causal"),
                             ((16, 16), (32, 8)), (1024, 4096), ("bf16", "fp16"))  # fmt: skip
    out = [dict(batch_size=2, head_dim_qk=d, attn_mask_type=m, num_heads=h, num_gqa_groups=g,
                max_seqlen_q=s, dtype=t) for d, m, (h, g), s, t in grid]  # fmt: skip
    return out[:n]


def worker(mode: str, rank: int, world: int, init: str, spec: str, out: str, graph: bool) -> None:
    import logging

    import torch.distributed as dist

    from te_fl_attention import FusedAttnConfig, Selector
    from te_fl_attention.cache import MemoryCache
    from te_fl_attention.device import profile
    from te_fl_attention.fleet import agree
    from te_fl_attention.probes import default_probes

    logging.getLogger("te_fl_attention.fleet").setLevel(logging.ERROR)  # the divergence note
    cfgs = [FusedAttnConfig(**c) for c in json.loads(Path(spec).read_text())]
    device = profile(DEVICES[rank % len(DEVICES)])
    sel = Selector(default_probes(graph=graph), cache=MemoryCache())
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    dist.barrier()
    t0 = time.perf_counter()
    if mode == "agree":
        agree(cfgs, mode="local", device=device, selector=sel)
    else:
        for c in cfgs:
            sel.decide(c, device)
    elapsed = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    probed = sel.stats["probes"] // len(sel.probes)  # configs probed (all candidates each)
    Path(out).write_text(json.dumps({"elapsed": elapsed, "probed": probed}))


def job(mode: str, world: int, spec: Path, tmp: Path, graph: bool) -> list[dict]:
    init = f"file://{tmp / f'rdv-{mode}'}"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, str(r), str(world),
                               init, str(spec), str(tmp / f"{mode}-{r}.json"), str(int(graph))],
                              env=env) for r in range(world)]  # fmt: skip
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"bench_fleet: a {mode} rank failed (exit {p.returncode})")
    return [json.loads((tmp / f"{mode}-{r}.json").read_text()) for r in range(world)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(a[0], int(a[1]), int(a[2]), a[3], a[4], a[5], a[6] == "1")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--configs", type=int, default=60)
    ap.add_argument("--no-graph", action="store_true", help="rules only (no cuDNN graphs)")
    args = ap.parse_args()
    if args.configs < 50:
        raise SystemExit("bench_fleet: use at least 50 configs")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as d:
        tmp = Path(d)
        spec = tmp / "configs.json"
        spec.write_text(json.dumps(configs(args.configs)))
        graph = not args.no_graph
        agreed = job("agree", args.ranks, spec, tmp, graph)
        alone = job("alone", args.ranks, spec, tmp, graph)
    wall_a = max(r["elapsed"] for r in agreed)
    wall_b = max(r["elapsed"] for r in alone)
    print(f"fleet ranks={args.ranks} types={len(DEVICES)} configs={args.configs} "
          f"graph={int(graph)} probes agree={sum(r['probed'] for r in agreed)} "
          f"alone={sum(r['probed'] for r in alone)} wall_s agree={wall_a:.2f} "
          f"alone={wall_b:.2f} ratio={wall_b / wall_a:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
