"""Our cuDNN graphs vs the ones TransformerEngine built, config by config.

Reads a cudnn-frontend log of TE's own graphs (``te_decisions.py --te-graph-log FILE`` writes one:
TE's C++ builds the forward and, for training, the backward graph of every config its Python
filters let through), builds our graphs for the same configs of :mod:`families` on this machine's
GPU (``--device``: another device profile, e.g. for the CPU test), pairs each of ours with TE's
graph of the same signature (SDPA node, Q/K/V dims and data types) and prints every difference
(options, tensors by role: dims, strides, data types, ragged offsets), then::

    graph_diff configs=N graphs=G identical=I differ=D unmatched=U

(``unmatched``: graphs of ours with no TE graph of that signature in the log, e.g. configs TE
refused before building a graph, or a graph TE sized differently). Writes ``graph_diff.json``
to ``--out``. Exit 0, 2 when the log holds no graph. **Never ran on a GPU**; its CPU test feeds
it a log made from our own graphs with one change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from families import write_report  # noqa: E402


def compare(logged: list[dict[str, Any]], device: str, limit: int | None = None
            ) -> dict[str, Any]:  # fmt: skip
    from families import configs

    from te_fl_attention.graphspec import match
    from te_fl_attention.probes import default_probes
    from te_fl_attention.selector import Selector

    selector = Selector(default_probes(graph=True))
    rows = []
    for family, cfg in configs()[:limit]:
        spec = selector.graph_spec(cfg, device) or {}
        for which, graph in (spec.get("graphs") or {}).items():
            theirs, differences = match(graph, logged)
            rows.append({"family": family, "config": cfg.to_dict(), "graph": which,
                         "matched": theirs is not None, "differences": differences})  # fmt: skip
    matched = [r for r in rows if r["matched"]]
    return {"configs": len(configs()[:limit]), "graphs": len(rows),
            "identical": sum(not r["differences"] for r in matched),
            "differ": sum(bool(r["differences"]) for r in matched),
            "unmatched": len(rows) - len(matched), "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, required=True, help="cudnn-frontend log of TE's graphs")
    ap.add_argument("--device", default="local", help="the device our graphs are built for")
    ap.add_argument("--limit", type=int, help="only the first N configs")
    ap.add_argument("--out", type=Path, help="directory for graph_diff.json")
    args = ap.parse_args(argv)
    from te_fl_attention.graphspec import graphs_in_log

    try:
        logged = graphs_in_log(args.log.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        print(f"graph_diff: skipped: cannot read {args.log}: {exc.strerror or exc}")
        return 2
    if not logged:
        print(f"graph_diff: skipped: no cuDNN graph in {args.log} (did TE run with "
              "CUDNN_FRONTEND_LOG_INFO=1?)")  # fmt: skip
        return 2
    result = compare(logged, args.device, args.limit)
    for r in result["rows"]:
        for line in r["differences"]:
            print(f"differ {r['family']} {r['graph']}: {line}")
    print(f"graph_diff configs={result['configs']} graphs={result['graphs']} "
          f"identical={result['identical']} differ={result['differ']} "
          f"unmatched={result['unmatched']}")  # fmt: skip
    write_report(args.out, "graph_diff", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
