"""Measured-mode regret over 30 configs on the local GPU.

GPU only. NOTE: this script has never run on a GPU (it was written on a CPU-only machine; its core
is tested on CPU through the fake GPU of tests/fakegpu). Without CUDA it prints one "skipped" line
and exits 0 (on CPU measured mode times scaled-down shapes and only the reference and the Triton
interpreter run: no regret worth printing).

For every config (Llama-3-style GQA and MHA head layouts x sequence lengths x masks x
training/inference, plus MLA, sliding-window, fp16, bshd, d64 and deterministic cases) the
selector decides twice on the local device: with TE's rule priority (``Policy()``) and in
measured mode (``Policy(measure=True)``: each supported candidate that can run here, flash-attn
flavours separately, is timed on the real shape, kernel launches only; the fastest wins among the
timed candidates' slots, an untimed one keeps its slot). With the measured timings (fwd+bwd for
training, fwd for inference) of the config:

* ``measured_vs_best`` = time(measured choice) / time(fastest timed unit) - 1: what measured mode
  leaves on the table (0 unless an untimed candidate kept a slot ahead, or force/prefer);
* ``rule_vs_measured`` = time(rule-priority choice) / time(measured choice) - 1: what measured
  mode gains over TE's priority.

A config whose choice was not timed (the runner cannot express it: torch SDPA's cuDNN backend
takes no sliding window or padding; too big to run) counts as ``untimed`` for that ratio. Prints
one line::

    measured_regret gpu=... configs=N timed=T differ=K measured_vs_best_mean=..% ..._max=..%
    rule_vs_measured_mean=..% rule_vs_measured_max=..% (worst: ...) untimed=U skipped=K seconds=S

``--out PATH`` writes every config's row and the summary as JSON (a directory: PATH/
bench_measured.json). ``--limit N`` runs the first N configs; ``--budget-s S`` starts no new
config after S seconds (a config takes seconds to a minute on a GPU: every candidate is timed
on the real shape, 3 + 10 launches per metric, and Triton compiles and tunes first).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from te_fl_attention import FusedAttnConfig, Policy, Selector  # noqa: E402
from te_fl_attention.cache import MemoryCache  # noqa: E402
from te_fl_attention.decide import metric  # noqa: E402
from te_fl_attention.presets import preset  # noqa: E402


def configs() -> list[FusedAttnConfig]:
    """30 distinct configs: 3 head layouts x 2 lengths x 2 masks x train/infer, + 6 special."""
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


def unit(decision: Any) -> str | None:
    """The backend that runs: the flash flavour when flash is chosen."""
    return decision.flash_variant or decision.chosen


def label(c: FusedAttnConfig) -> str:
    dims = f"d{c.head_dim_qk}" + (f"/{c.head_dim_v}" if c.head_dim_v != c.head_dim_qk else "")
    return (f"{c.num_heads}/{c.num_gqa_groups}h {dims} s{c.max_seqlen_q} {c.qkv_format} "
            f"{c.attn_mask_type} {c.dtype}" + (" window" if c.has_window else "")
            + (" det" if c.deterministic else "") + f" {metric(c)}")  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b - 1.0 if a is not None and b else None


def regret(cases: list[FusedAttnConfig], selector: Selector | None = None,
           device: str = "local", budget_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Decide every config by rule priority and by measurement; the rows and the summary.
    ``budget_s``: start no new config after that many seconds (``skipped`` counts the rest)."""
    sel = selector if selector is not None else Selector(cache=MemoryCache())
    rows = []
    t0 = time.perf_counter()
    for c in cases:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        rule = sel.decide(c, device, Policy())
        measured = sel.decide(c, device, Policy(measure=True))
        m = metric(c)
        times = {u: t[m] for u, t in (measured.detail.get("timings_ms") or {}).items() if m in t}
        a, b = unit(rule), unit(measured)
        best = min(times, key=lambda u: times[u]) if times else None
        t_rule, t_measured = times.get(a), times.get(b)
        rows.append({
            "config": label(c), "config_key": c.key(), "metric": m, "rule_choice": a,
            "measured_choice": b, "fastest": best, "timings_ms": times,
            "measured_vs_best": _ratio(t_measured, times.get(best)),
            "rule_vs_measured": _ratio(t_rule, t_measured),
            "untimed": measured.detail.get("measured", {}).get("untimed", []),
        })  # fmt: skip
    vs_best = [r["measured_vs_best"] for r in rows if r["measured_vs_best"] is not None]
    vs_rule = [r for r in rows if r["rule_vs_measured"] is not None]
    worst = max(vs_rule, key=lambda r: r["rule_vs_measured"], default=None)
    summary = {
        "configs": len(rows), "timed": len(vs_best),
        "differ": sum(r["rule_choice"] != r["measured_choice"] for r in rows),
        "measured_vs_best_mean": statistics.mean(vs_best) if vs_best else None,
        "measured_vs_best_max": max(vs_best, default=None),
        "rule_vs_measured_mean": (statistics.mean(r["rule_vs_measured"] for r in vs_rule)
                                  if vs_rule else None),
        "rule_vs_measured_max": worst["rule_vs_measured"] if worst else None,
        "worst": (f"{worst['config']}: {worst['rule_choice']} vs {worst['measured_choice']}"
                  if worst else "-"),
        "untimed": len(rows) - len(vs_rule), "skipped": len(cases) - len(rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    return {"summary": summary, "rows": rows}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def summary_line(gpu: str, s: dict[str, Any]) -> str:
    return (f"measured_regret gpu={gpu.replace(' ', '_')} configs={s['configs']} "
            f"timed={s['timed']} differ={s['differ']} "
            f"measured_vs_best_mean={_pct(s['measured_vs_best_mean'])} "
            f"measured_vs_best_max={_pct(s['measured_vs_best_max'])} "
            f"rule_vs_measured_mean={_pct(s['rule_vs_measured_mean'])} "
            f"rule_vs_measured_max={_pct(s['rule_vs_measured_max'])} (worst: {s['worst']}) "
            f"untimed={s['untimed']} skipped={s['skipped']} seconds={s['seconds']}")  # fmt: skip


def write(out: str, gpu: str, result: dict[str, Any]) -> Path:
    path = Path(out)
    if path.is_dir() or out.endswith("/"):
        path.mkdir(parents=True, exist_ok=True)
        path = path / "bench_measured.json"
    path.write_text(json.dumps({"gpu": gpu, **result}, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the rows and the summary as JSON (file or directory)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N configs")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new config after this many seconds (the rest: skipped)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("measured_regret skipped: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 0
    gpu = torch.cuda.get_device_name()  # gpu-only
    result = regret(configs()[: args.limit], budget_s=args.budget_s)
    print(summary_line(gpu, result["summary"]))
    if args.out:
        write(args.out, gpu, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
