"""cuDNN's verdicts with a real handle on this machine's GPU vs deviceless with its descriptor.

For every config of :mod:`families` (TE's test families, >= 40 configs) cuDNN is asked three times
in the probe worker of the current GPU (``get_worker(ordinal)``, narrowed to that GPU):

* ``real``: with a real cuDNN handle on the GPU (mode ``device``);
* ``captured``: deviceless, with the descriptor captured from the same GPU
  (``capture_local_descriptor``);
* ``catalog``: deviceless, with the typed catalog descriptor of this GPU (``h200.json`` on an
  H200; matched by name, else by sm and SM count; ``--catalog NAME`` names it), when there is one.

A config agrees when the three verdicts (supported / refused / undecided with its code) are equal.
Plan names are compared too and reported on their own line (a different plan list with the same
verdict is not a disagreement). Prints every disagreement and every plan difference, then::

    cudnn_plans configs=N same=S differ=P
    cudnn_agreement configs=N agree=A disagree=D

and writes ``cudnn_agreement.json`` to ``--out``. Exit 0 (disagreements are data), 2 on a setup
error (no GPU, no cuDNN, a capture failure, or a worker that could not plan with a real handle).
``--dry-run`` lists what it would do and exits 0 anywhere. **Never ran on a GPU** (written on a
CPU-only machine); its CPU test runs it in-process through the test suite's hardware seam (a fake
GPU and a fake cuDNN handle over the real deviceless planner).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [p for p in (str(HERE), str(ROOT)) if p not in sys.path]

from families import write_report  # noqa: E402

#: ``probe(config_dict, descriptor, sm, use_real_gpu) -> fused.graph result``.
Prober = Callable[[Mapping[str, Any], Mapping[str, Any] | None, int | None, bool], dict[str, Any]]

QUESTIONS = ("real", "captured", "catalog")


class SetupError(RuntimeError):
    """The comparison cannot run here (exit 2)."""


def verdict(r: Mapping[str, Any] | None) -> str | None:
    """``supported``, ``refused`` or ``undecided:<code>`` (``None``: not asked)."""
    if r is None:
        return None
    if r.get("decided"):
        return "supported" if r.get("supported") else "refused"
    return f"undecided:{r.get('code')}"


def _brief(r: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {k: r.get(k) for k in ("supported", "decided", "code", "graph", "step", "summary",
                                  "mode", "driver", "plans", "heur_mode", "notes", "elapsed_ms")}


def compare_row(family: str, config: Mapping[str, Any], real: Mapping[str, Any],
                captured: Mapping[str, Any], catalog: Mapping[str, Any] | None) -> dict[str, Any]:
    """One config's three answers, compared (a pure function: the CPU test feeds it)."""
    answers = {"real": real, "captured": captured, "catalog": catalog}
    verdicts = {q: verdict(a) for q, a in answers.items() if a is not None}
    agree = len(set(verdicts.values())) == 1
    plan_diffs = [q for q in ("captured", "catalog") if answers[q] is not None
                  and (answers[q].get("plans") or {}) != (real.get("plans") or {})]  # fmt: skip
    return {"family": family, "config": dict(config), "verdicts": verdicts, "agree": agree,
            "plans_same": not plan_diffs, "plans_differ": plan_diffs,
            "real_mode": real.get("mode"),
            "answers": {q: _brief(a) for q, a in answers.items()}}  # fmt: skip


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    agree = sum(bool(r["agree"]) for r in rows)
    same = sum(bool(r["plans_same"]) for r in rows)
    return {"configs": len(rows), "agree": agree, "disagree": len(rows) - agree,
            "plans_same": same, "plans_differ": len(rows) - same}  # fmt: skip


def catalog_twin(captured: Mapping[str, Any], name: str | None = None
                 ) -> tuple[str | None, dict[str, Any] | None]:  # fmt: skip
    """The catalog GPU whose typed descriptor describes the captured device: ``name`` when
    given, else the one with the same device name, else the same sm and SM count with the
    nearest memory size. Typed files only (an installed capture is not a catalog answer)."""
    from te_fl_attention.descriptors import CATALOG_NAMES, _load_text

    typed = {n: json.loads(_load_text(n)) for n in CATALOG_NAMES}
    if name is not None:
        if name not in typed:
            raise SetupError(f"--catalog {name}: no catalog GPU of that name")
        return name, typed[name]
    for n, d in typed.items():
        if d["deviceName"] == captured.get("deviceName"):
            return n, d
    same = [(abs(d["totalGlobalMem"] - captured.get("totalGlobalMem", 0)), n)
            for n, d in typed.items() if d["deviceVer"] == captured.get("deviceVer")
            and d["multiProcessorCount"] == captured.get("multiProcessorCount")]  # fmt: skip
    if not same:
        return None, None
    n = min(same)[1]
    return n, typed[n]


def worker_prober(ordinal: int, timeout_s: float) -> tuple[Prober, Callable[[], Any]]:
    """Questions answered by the probe worker of device ``ordinal`` (crash-isolated)."""
    from te_fl_attention.probes.fused.worker import get_worker

    w = get_worker(ordinal)

    def probe(cfg: Mapping[str, Any], desc: Mapping[str, Any] | None, sm: int | None,
              real: bool) -> dict[str, Any]:  # fmt: skip
        return w.probe(cfg, desc, sm, timeout_s=timeout_s, use_real_gpu=real)

    return probe, lambda: w.hello


def in_process_prober() -> tuple[Prober, Callable[[], Any]]:
    """Questions answered in this process (the CPU test; a cuDNN abort ends the script)."""
    from te_fl_attention.probes.fused import graph as fused_graph

    def probe(cfg: Mapping[str, Any], desc: Mapping[str, Any] | None, sm: int | None,
              real: bool) -> dict[str, Any]:  # fmt: skip
        return fused_graph.probe_config(cfg, desc, sm, use_real_gpu=real)

    return probe, lambda: {"in_process": True, **fused_graph.backend_status()}


def select(families: Sequence[str] | None, limit: int | None) -> list[tuple[str, Any]]:
    from families import configs

    chosen = [(f, c) for f, c in configs() if not families or f in families]
    return chosen[:limit]


def run(probe: Prober, configs: Sequence[tuple[str, Any]], captured: Mapping[str, Any],
        catalog: Mapping[str, Any] | None) -> list[dict[str, Any]]:  # fmt: skip
    """Ask the three questions for every config; raise :class:`SetupError` when the real
    question was answered without a real handle (the worker found no GPU driver)."""
    from te_fl_attention.config import FusedAttnConfig
    from te_fl_attention.descriptors import descriptor_sm

    sm = descriptor_sm(captured)
    check = probe(FusedAttnConfig(attn_mask_type="causal").to_dict(), captured, sm, True)
    if check.get("mode") != "device":
        raise SetupError("the probe worker did not plan with a real handle "
                         f"(mode={check.get('mode')}, code={check.get('code')}): "
                         f"{check.get('message') or '; '.join(check.get('notes') or [])}"[:600])
    rows = []
    for family, cfg in configs:
        d = cfg.to_dict()
        t0 = time.perf_counter()
        real = probe(d, captured, sm, True)
        cap = probe(d, captured, sm, False)
        cat = probe(d, catalog, descriptor_sm(catalog), False) if catalog is not None else None
        row = compare_row(family, d, real, cap, cat)
        row["elapsed_s"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    return rows


def _describe(r: Mapping[str, Any]) -> str:
    parts = []
    for q in QUESTIONS:
        a = r["answers"].get(q)
        if a is None:
            continue
        where = f" at {a['graph']}.{a['step']}" if a.get("step") else ""
        why = f" ({(a.get('summary') or '')[:160]})" if a.get("summary") else ""
        parts.append(f"{q}={r['verdicts'][q]}{where}{why}")
    return f"{r['family']} {_fields(r['config'])}: " + "; ".join(parts)


def _fields(config: Mapping[str, Any]) -> str:
    """The fields of a config that differ from the default config, as compact JSON."""
    from te_fl_attention.config import FusedAttnConfig

    default = FusedAttnConfig().to_dict()
    diff = {k: v for k, v in config.items() if default.get(k) != v}
    return json.dumps(diff, separators=(",", ":"), default=str)


def report_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every disagreement and plan difference, the plan summary, then the summary line."""
    lines = [f"disagree {_describe(r)}" for r in rows if not r["agree"]]
    for r in rows:
        for q in r["plans_differ"]:
            real = r["answers"]["real"]["plans"]
            other = r["answers"][q]["plans"]
            lines.append(f"plans {r['family']} real={json.dumps(real)} {q}={json.dumps(other)}")
    s = summarize(rows)
    lines.append(f"cudnn_plans configs={s['configs']} same={s['plans_same']} "
                 f"differ={s['plans_differ']}")  # fmt: skip
    lines.append(f"cudnn_agreement configs={s['configs']} agree={s['agree']} "
                 f"disagree={s['disagree']}")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="directory for cudnn_agreement.json")
    ap.add_argument("--dry-run", action="store_true", help="list what would run, exit 0")
    ap.add_argument("--family", action="append", help="only this family (repeatable)")
    ap.add_argument("--limit", type=int, help="only the first N configs")
    ap.add_argument("--catalog", help="the catalog GPU to compare with (default: matched)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per cuDNN question")
    ap.add_argument("--in-process", action="store_true",
                    help="ask cuDNN in this process instead of the probe worker (tests)")
    args = ap.parse_args(argv)
    configs = select(args.family, args.limit)
    if args.dry_run:
        print(f"cudnn_agreement dry-run: {len(configs)} configs x {len(QUESTIONS)} cuDNN "
              "questions (real handle on the current GPU; deviceless with its captured "
              "descriptor; deviceless with its catalog descriptor), in the probe worker of the "
              f"current GPU; writes {args.out or '<--out>'}/cudnn_agreement.json")  # fmt: skip
        for family, cfg in configs:
            print(f"  {family}: {_fields(cfg.to_dict())}")
        return 0
    t0 = time.perf_counter()
    try:
        result = _compare(args, configs)
    except SetupError as exc:
        print(f"cudnn_agreement: setup error: {exc}", file=sys.stderr)
        print("cudnn_agreement configs=0 agree=0 disagree=0 (setup error)")
        return 2
    finally:
        if not args.in_process:
            from te_fl_attention.probes.fused.worker import close_workers

            close_workers()
    for line in report_lines(result["rows"]):
        print(line)
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    write_report(args.out, "cudnn_agreement", result)
    return 0


def _compare(args: argparse.Namespace, configs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    import importlib.util

    from te_fl_attention.descriptors import (
        DescriptorError,
        capture_local_descriptor,
        current_ordinal,
    )
    from te_fl_attention.device import local

    dev = local()
    if not dev.has_gpu:
        raise SetupError("no CUDA GPU on this machine")
    if importlib.util.find_spec("cudnn") is None:
        raise SetupError("cudnn-frontend is not installed (pip install 'te-fl-attention[cudnn]')")
    ordinal = current_ordinal()
    try:
        captured = capture_local_descriptor(ordinal)
    except DescriptorError as exc:
        raise SetupError(f"capturing device {ordinal} failed: {exc}") from None
    twin, catalog = catalog_twin(captured, args.catalog)
    probe, hello = in_process_prober() if args.in_process else worker_prober(ordinal,
                                                                             args.timeout)
    rows = run(probe, configs, captured, catalog)
    return {"gpu": captured["deviceName"], "ordinal": ordinal, "catalog": twin,
            "captured": captured, "worker": hello(), **summarize(rows), "rows": rows}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
