"""Our decision vs TransformerEngine's own ``get_attention_backend`` on this machine's GPU.

For every config of :mod:`families` it builds TE's ``AttentionParams`` (as ``DotProductAttention``
does), asks TE's own selection (the plugin must be off: ``NVTE_PLUGIN`` unset, so
``get_attention_backend`` is TE's code, whose fused query runs TE's C++ against cuDNN) and ours
(``TEBackend`` over a selector with cuDNN graph builds, for the local device), and compares the
backend each would run: flash (with its flash-attn version), fused (with its sub-backend) or
unfused. TE is asked first for every config, then us, so that with ``--te-graph-log FILE`` the
cudnn-frontend log holds the graphs TE's C++ built for its support query and nothing of ours (our
probe workers are started without the log switches); ``graph_diff.py`` compares them with ours.
Prints every disagreement with our reasons for refusing TE's choice, then::

    te_decisions gpu=NAME configs=N agree=A disagree=D

and writes ``te_decisions.json`` to ``--out``. Exit 0 (disagreements are data), 2 when TE or a GPU
is missing. **Never ran on a GPU** (written on a CPU-only machine); its CPU test runs it against
TE 2.20.2 with a stub extension through the test suite's hardware seam.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests" / "probes")]

from families import write_report  # noqa: E402

DPA_UTILS = "transformer_engine.pytorch.attention.dot_product_attention.utils"
#: cudnn-frontend's logging switches (TE's graphs are logged with them, see ``--te-graph-log``).
LOG_ENV = ("CUDNN_FRONTEND_LOG_INFO", "CUDNN_FRONTEND_LOG_FILE")


def chosen(t: tuple) -> str:
    """The backend a TE 6-tuple runs: ``flash:<flash-attn version>`` (ours: our Triton kernel's
    version label), ``fused:<sub-backend>``, ``unfused`` or ``none``."""
    use_flash, flash_version, use_fused, fused_backend, use_unfused = t[:5]
    if use_flash:
        return f"flash:{flash_version}"
    if use_fused:
        return f"fused:{int(getattr(fused_backend, 'value', fused_backend))}"
    return "unfused" if use_unfused else "none"


def compare(limit: int | None = None) -> dict[str, Any]:
    """Both answers for every config (TE must already be imported, plugin off)."""
    import torch
    from families import configs
    from te_cpu import attention_params

    from te_fl_attention.cache import MemoryCache
    from te_fl_attention.plugin.te_backend import TEBackend
    from te_fl_attention.probes import default_probes
    from te_fl_attention.selector import Selector

    utils = sys.modules[DPA_UTILS]
    if getattr(utils.get_attention_backend, "__module__", "").startswith("te_fl_attention"):
        raise RuntimeError("NVTE_PLUGIN is active: TE's own get_attention_backend is replaced")
    import transformer_engine.common.recipe as recipe

    te_ns = types.SimpleNamespace(utils=utils, recipe=recipe)
    cases = configs()[:limit]
    rows = []
    for family, cfg in cases:  # TE first: a cudnn-frontend log then holds TE's graphs only
        row: dict[str, Any] = {"family": family, "config": cfg.to_dict()}
        try:
            row["te"] = chosen(utils.get_attention_backend(attention_params(te_ns, cfg)))
        except Exception as exc:  # noqa: BLE001 - TE refusing outright is an answer too
            row["te"] = f"error: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    for name in LOG_ENV:  # our probe workers must not write into TE's graph log
        os.environ.pop(name, None)
    ours = TEBackend(Selector(default_probes(graph=True), cache=MemoryCache()), None)
    for row, (_, cfg) in zip(rows, cases, strict=True):
        decision = ours.selector.decide(cfg, ours.device)
        row["ours"] = chosen(ours(attention_params(te_ns, cfg)))
        row["agree"] = row["te"] == row["ours"]
        te_backend = row["te"].split(":")[0]
        if not row["agree"] and te_backend in ("flash", "fused", "unfused"):
            r = decision.result(te_backend)
            row["our_reasons"] = [f"{x.code}: {x.message}"[:300] for x in r.reasons]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    agree = sum(r["agree"] for r in rows)
    return {"gpu": name, "configs": len(rows), "agree": agree, "disagree": len(rows) - agree,
            "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="directory for te_decisions.json")
    ap.add_argument("--limit", type=int, help="only the first N configs")
    ap.add_argument("--te-graph-log", type=Path,
                    help="write the cuDNN graphs TE builds for its support query to this file "
                    "(cudnn-frontend's log), for scripts/gpu/graph_diff.py")  # fmt: skip
    ap.add_argument("--imported", action="store_true",
                    help="TE is already imported by the caller (tests)")  # fmt: skip
    args = ap.parse_args(argv)
    if os.environ.get("NVTE_PLUGIN"):
        print("te_decisions: unset NVTE_PLUGIN (TE's own selection is compared)", file=sys.stderr)
        return 2
    if args.te_graph_log:  # before TE (and its cudnn-frontend) is loaded
        args.te_graph_log.parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(CUDNN_FRONTEND_LOG_INFO="1",
                          CUDNN_FRONTEND_LOG_FILE=str(args.te_graph_log))  # fmt: skip
    if not args.imported:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - not installed, or its extension cannot load
            print(f"te_decisions: skipped: transformer_engine.pytorch does not import here: "
                  f"{type(exc).__name__}: {exc}"[:400])  # fmt: skip
            return 2
    result = compare(args.limit)
    for r in result["rows"]:
        if not r["agree"]:
            print(f"disagree {r['family']}: te={r['te']} ours={r['ours']} "
                  f"{'; '.join(r.get('our_reasons', []))[:400]}")  # fmt: skip
    print(f"te_decisions gpu={result['gpu'].replace(' ', '_')} configs={result['configs']} "
          f"agree={result['agree']} disagree={result['disagree']}")  # fmt: skip
    write_report(args.out, "te_decisions", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
