"""One rank of a simulated mixed job for tests/fleet/test_agree.py (run as a script).

``python agree_worker.py SCENARIO RANK WORLD INIT_METHOD OUT_DIR``: joins a gloo group, runs the
scenario's ``agree`` calls and writes ``OUT_DIR/rank<RANK>.json`` with what the test checks:
per call the decisions, the number of collectives this rank took part in and its probe count.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

import torch.distributed as dist

from te_fl_attention import FusedAttnConfig, NoBackendError, Policy, Selector
from te_fl_attention.cache import ProbeCache
from te_fl_attention.device import profile
from te_fl_attention.fleet import agree
from te_fl_attention.probes import default_probes

COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "all_gather",
               "all_reduce", "broadcast", "barrier", "scatter_object_list", "reduce")
CALLS = {"n": 0}

S1 = [FusedAttnConfig(head_dim_qk=hd, num_heads=8, attn_mask_type=m)
      for hd in (64, 128, 192) for m in ("no_mask", "causal")]
S2 = [FusedAttnConfig(head_dim_qk=hd, num_heads=16, max_seqlen_q=512) for hd in (64, 96, 128, 256)]
# On a100 only FlashAttention runs this; on h100 without flash-attn only FusedAttention does.
SPLIT = FusedAttnConfig(head_dim_qk=192, num_heads=8, is_training=True)
G = [FusedAttnConfig(head_dim_qk=hd, num_heads=8, attn_mask_type="causal") for hd in (64, 128)]

SCENARIOS = {
    "mixed": {"devices": ["a100", "h100:fa2=none", "a100", "h100:fa2=none"], "graph": False},
    "graph": {"devices": ["h100", "b200", "h100", "b200"], "graph": True},
}


def _count(name):
    real = getattr(dist, name)

    def counted(*args, **kwargs):
        CALLS["n"] += 1
        return real(*args, **kwargs)

    setattr(dist, name, counted)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def summary(decisions):
    return [[d.chosen, d.flash_variant, d.source,
             [[r.backend, r.supported, r.stage] for r in d.results]] for d in decisions]


LOGS = Records()


def call(sel, configs, **kw):
    """One agree() call: its decisions (or error), collectives, probes and warnings here."""
    n0, p0, w0 = CALLS["n"], sel.stats["probes"], len(LOGS.messages)
    out = {}
    try:
        out["decisions"] = summary(agree(configs, selector=sel, **kw))
    except NoBackendError as exc:
        out["error"] = str(exc)
    out["collectives"] = CALLS["n"] - n0
    out["probes"] = sel.stats["probes"] - p0
    out["warnings"] = LOGS.messages[w0:]
    return out


def main(scenario, rank, world, init, out_dir):
    spec = SCENARIOS[scenario]
    device = profile(spec["devices"][rank])
    cache = ProbeCache(os.path.join(out_dir, f"cache-rank{rank}.sqlite"))
    graph = spec["graph"]
    result = {"rank": rank, "device": spec["devices"][rank]}
    if scenario == "mixed":  # warm caches before joining: a non-prober for S1, a prober for S2
        warm = Selector(default_probes(graph=False), cache=cache)
        for config in (S1 if rank == 2 else S2 if rank == 0 else []):
            warm.probe_all(config, device)
    for name in COLLECTIVES:
        _count(name)
    logging.getLogger("te_fl_attention.fleet").addHandler(LOGS)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    sel = Selector(default_probes(graph=graph), cache=cache)
    if scenario == "mixed":
        result["local"] = call(sel, S1, mode="local", device=device)
        result["uniform"] = call(sel, S2, mode="uniform", device=device)
        result["none"] = call(sel, [SPLIT], mode="uniform", device=device,
                              policy=Policy(unfused=False, triton=False))
        # ragged: every rank passes a shared config and one of its own (varlen-like seqlens)
        for mode, heads in (("local", 4), ("uniform", 2)):
            mine = [FusedAttnConfig(num_heads=heads, max_seqlen_q=4096),
                    FusedAttnConfig(num_heads=heads, max_seqlen_q=256 + 64 * rank)]
            result[f"ragged_{mode}"] = call(sel, mine, mode=mode, device=device)
        again = Selector(default_probes(graph=False), cache=cache)  # a fresh process's view
        for dev in {profile(d) for d in spec["devices"]}:
            for config in S1:
                again.decide(config, dev)
        result["reprobes"] = again.stats["probes"]
    else:
        result["local"] = call(sel, G, mode="local", device=device)
        result["uniform"] = call(sel, G, mode="uniform", device=device)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
