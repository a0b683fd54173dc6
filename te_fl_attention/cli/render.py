"""Human and JSON renderings of a `Decision` (rich is imported here, lazily)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Any, TextIO

from ..reasons import Decision, ProbeResult, Reason

#: What never reaches a terminal raw: C0 controls but tab/newline, DEL, C1 controls (ESC starts
#: ANSI/OSC sequences, 0x9b is a one-byte CSI), and lone surrogates (not encodable).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(text: Any) -> str:
    """``text`` fit for a terminal: control characters and lone surrogates shown as escapes
    (``\\x1b``, ``\\ud800``), so no ANSI/OSC sequence is interpreted and printing never fails."""
    text = text if isinstance(text, str) else str(text)
    if not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace")
                       .decode("ascii"), text)  # fmt: skip


def safe_markup(text: Any) -> str:
    """:func:`safe_text` for a rich cell or line: shown as it is, never taken as markup."""
    from rich.markup import escape

    return escape(safe_text(text))


def strict_json(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats become ``None``, lone surrogates in
    strings (keys too) become U+FFFD, tuples lists."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {strict_json(str(k)): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def to_json(decision: Decision, indent: int | None = 2) -> str:
    """The decision as strict JSON (the same content the table shows): no NaN/Infinity, no lone
    surrogates, every control character escaped."""
    return json.dumps(strict_json(decision.to_dict()), indent=indent, sort_keys=False,
                      allow_nan=False)  # fmt: skip


# ------------------------------------------------------------------------------------ hints
#: Reason code prefix -> the device field whose override changes the answer.
_HINT_FIELDS = {"fa2.": "flash_attn", "fa3.": "flash_attn_3", "fa4.": "flash_attn_4",
                "triton.": "triton", "fused.": "cudnn"}  # fmt: skip
#: The version suggested when the hint names none (the matrix's assumptions).
_SUGGEST = {"flash_attn": "2.8.3", "flash_attn_3": "3.0.0b1", "flash_attn_4": "4.0.0b36",
            "triton": "3.7.1", "cudnn": "9.28.1"}  # fmt: skip
_INSTALL_HINT = re.compile(r"pip install|build flash-attn|^use cuDNN")
_MIN_VERSION = re.compile(r"(?:>=\s*|cuDNN )([0-9][0-9A-Za-z.]*[0-9A-Za-z])")


def fit_hints(decision: Decision, spec: str | None) -> Decision:
    """Hints that fit the question. For a catalog or overridden device (``spec``, as the user
    gave it), a hint to install a library is replaced by the override that changes the answer
    (``--device h100:flash_attn_4=4.0.0b36``); where the user said ``FIELD=none`` there is no
    install hint at all. A plain local question keeps its ``pip install`` hints."""
    from ..device import override_key, parse_spec

    if not spec:
        return decision
    name, given = parse_spec(spec)
    said = {}
    for key, value in given.items():
        try:
            said[override_key(key)] = value
        except ValueError:
            continue
    if name == "local" and not said:
        return decision

    def hint_for(r: Reason) -> Reason:
        if not r.hint or not _INSTALL_HINT.search(r.hint):
            return r
        field = next((f for p, f in _HINT_FIELDS.items() if r.code.startswith(p)), None)
        if field is None or (field == "cudnn" and "te-fl-attention[" in r.hint):
            return r
        if said.get(field, "").lower() == "none":
            return dataclasses.replace(r, hint=None)
        if name == "local":
            return r
        m = _MIN_VERSION.search(r.hint)
        version = m.group(1) if m and field != "flash_attn" else _SUGGEST[field]
        items = {**said, field: version}
        override = f"{name}:" + ",".join(f"{k}={v}" for k, v in items.items())
        return dataclasses.replace(r, hint=f"a what-if answer changes with the device, not a "
                                   f"local install: --device {override}")  # fmt: skip

    def fix(result: ProbeResult) -> ProbeResult:
        reasons = tuple(map(hint_for, result.reasons))
        variants = tuple(map(fix, result.variants))
        if reasons == result.reasons and variants == result.variants:
            return result
        return dataclasses.replace(result, reasons=reasons, variants=variants)

    results = tuple(map(fix, decision.results))
    return decision if results == decision.results else dataclasses.replace(decision,
                                                                           results=results)


def _reason_text(r: Reason) -> str:
    text = f"[{r.stage}] {r.message}"
    if r.limit is not None and str(r.limit) not in r.message:
        text += f" (limit: {r.limit})"
    if r.hint:
        text += f"\n    hint: {r.hint}"
    return text


def _verdict(result: ProbeResult, chosen: str | None, variant: str | None) -> str:
    if result.backend in (chosen, variant):
        return "CHOSEN"
    return "supported" if result.supported else "refused"


def _notes(r: ProbeResult) -> list[str]:
    """Evidence worth showing next to a verdict: cuDNN's plans, rule drift, predictions."""
    notes = []
    plans = r.detail.get("plans") or {}
    for graph, names in plans.items():
        if names:
            notes.append(f"cuDNN {graph} plans: {', '.join(names[:6])}"
                         + (f" (+{len(names) - 6})" if len(names) > 6 else ""))  # fmt: skip
    drift = r.detail.get("rule_drift")
    if drift:
        notes.append(f"rule drift: rules {drift['rules']} ({', '.join(drift['rule_codes']) or '-'})"
                     f", cuDNN {drift['cudnn']}; cuDNN's verdict wins")  # fmt: skip
    if r.detail.get("predicted"):
        why = r.detail.get("graph_note")
        what = "the support table" if r.backend == "fused" else "the rules (nothing ran)"
        notes.append(f"predicted by {what}" + (f" ({why})" if why else ""))
    if r.evidence != "rules":
        notes.append(f"evidence: {r.evidence}")
    return notes + _stage_notes(r)


def _stage_notes(r: ProbeResult) -> list[str]:
    """Verification and timing notes (measured / verified mode), and skipped tiny runs."""
    notes = []
    if r.detail.get("run_note"):
        notes.append(str(r.detail["run_note"]))
    num = r.detail.get("numerics") or {}
    if num.get("skipped"):
        notes.append(f"numerics: {num['skipped']}")
    elif num.get("max_error"):
        errs = num["max_error"]
        worst = max(errs, key=lambda n: errs[n])
        ok = "<=" if errs[worst] <= num["tolerance"] else ">"
        notes.append(f"numerics: max error {errs[worst]:.2g} ({worst}) {ok} {num['tolerance']:g}"
                     + "".join(f"; {n}" for n in num.get("notes") or ()))  # fmt: skip
    t = r.detail.get("timings_ms")
    if t:
        parts = [f"{k.replace('_', '+')} {v:.3g} ms" for k, v in t.items()]
        notes.append(f"timed: {', '.join(parts)} (median of {r.detail.get('repeats', '?')})")
    if r.detail.get("timing_note"):
        notes.append(f"timing: {r.detail['timing_note']}")
    return notes


def rows(decision: Decision) -> list[tuple[str, str, str, str]]:
    """(candidate, verdict, stage, reasons) rows, flash flavours indented under flash. Every
    cell is :func:`safe_text`; a refused row always says why."""
    out = []
    variant = decision.detail.get(f"{decision.chosen}_variant")
    by_name = {r.backend: r for r in decision.results}
    for name in decision.order or tuple(by_name):
        if name not in by_name:
            continue
        r = by_name[name]
        label = r.display_name
        if r.backend == "fused" and r.supported and r.detail.get("sub_backend") is not None:
            label += f" (sub-backend {r.detail['sub_backend']})"
        shown = r.reasons
        notes = _notes(r)
        if r.variants:  # a flavour's own reasons are shown under it
            own = tuple(f"{v.backend}." for v in r.variants)
            shown = tuple(x for x in r.reasons if not x.code.startswith(own))
        text = "\n".join([*(_reason_text(x) for x in shown), *notes])
        verdict = _verdict(r, decision.chosen, None)
        if verdict == "refused" and not shown:
            text = "\n".join(["no flavour can run it (each flavour's reasons below)"
                               if r.variants else "refused (no reason recorded)", *notes])
        out.append((safe_text(label), verdict, safe_text(r.stage), safe_text(text)))
        shared = {(x.code, x.message) for x in shown}
        for v in r.variants:
            own = [x for x in v.reasons if (x.code, x.message) not in shared]
            ver = v.detail.get("version")
            label = f"  └ {v.display_name}" + (f" {ver}" if ver else "")
            mine = variant if decision.chosen == r.backend else None
            verdict = _verdict(v, decision.chosen, mine)
            text = [*(_reason_text(x) for x in own), *_stage_notes(v)]
            if verdict == "refused" and not own:
                text = ["refused for the reasons above"]
            out.append((safe_text(label), verdict, safe_text(v.stage),
                        safe_text("\n".join(text))))  # fmt: skip
    return out


def render(decision: Decision, file: TextIO | None = None, width: int | None = None) -> None:
    """Print the decision as a table: every candidate, its verdict, stage and reasons. Text from
    outside (device names, imported reasons) is :func:`safe_text`: no terminal control
    sequence is printed raw and a lone surrogate never fails the output."""
    from rich.console import Console
    from rich.table import Table

    out = file if file is not None else sys.stdout
    if width is None and not out.isatty():
        width = 140  # pipes and logs: wide enough that names are not folded
    console = Console(file=out, width=width, soft_wrap=False)
    dev = decision.device
    title = safe_markup(f"Attention backend on {dev.name} "
                        f"(sm{dev.sm if dev.sm is not None else ' none'})")  # fmt: skip
    table = Table(title=title, show_lines=True)
    for col in ("candidate", "verdict", "stage", "reasons"):
        table.add_column(col, overflow="fold")

    styles = {"CHOSEN": "bold green", "supported": "green", "refused": "red"}
    for label, verdict, stage, reasons in rows(decision):
        table.add_row(safe_markup(label), f"[{styles[verdict]}]{verdict}[/]", safe_markup(stage),
                      safe_markup(reasons))  # fmt: skip
    console.print(table)
    chosen = decision.chosen_result
    if chosen is None:
        force = (decision.policy or {}).get("force")
        if force:
            shown = decision.result(force).display_name if _has(decision, force) else force
            console.print(safe_markup(f"no backend: force={force} and {shown} cannot run this "
                                      "config (its reasons are above)"))  # fmt: skip
        else:
            console.print("[bold red]no backend supports this config[/]")
    else:
        extra = ""
        if decision.detail.get("flash_variant"):
            extra = f" via {decision.result(decision.detail['flash_variant']).display_name}"
        console.print(f"chosen: [bold]{safe_markup(chosen.display_name)}[/]{safe_markup(extra)}")
    console.print(safe_markup(f"order considered: {' > '.join(map(str, decision.order))}"))
    for line in measured_lines(decision):
        console.print(safe_markup(line))
    console.print(safe_markup(f"config key: {decision.config.key()}  (source: {decision.source})"))
    spec = decision.detail.get("graph_spec")
    if spec is not None:
        render_graphs(spec, console)


def _has(decision: Decision, backend: str) -> bool:
    try:
        decision.result(backend)
    except KeyError:
        return False
    return True


def _shape(values: Any) -> str:
    return "x".join(str(v) for v in values) if isinstance(values, list) else str(values)


def render_graphs(spec: dict[str, Any], console: Any) -> None:
    """The cuDNN graphs the fused probe built (``explain --show-graph``): per graph, the SDPA
    node's options and every tensor it reads or writes, in cudnn-frontend's vocabulary; then,
    with a TE log to compare with, every difference."""
    from rich.table import Table

    from ..graphspec import options, roles

    if spec.get("message"):
        console.print(safe_markup(f"graph spec: {spec['message']}"))
    for which, graph in (spec.get("graphs") or {}).items():
        opts = options(graph)
        title = safe_markup(f"cuDNN {which} graph ({spec.get('mode') or '?'}, "
                            f"cuDNN {spec.get('cudnn_version')})")
        table = Table(title=title, show_lines=False)
        for col in ("role", "tensor", "dims", "strides", "data type", "ragged offset", "by value"):
            table.add_column(col, overflow="fold")
        for role, t in roles(graph).items():
            off = t.get("ragged_offset")
            mult = t.get("ragged_offset_multiplier")
            ragged = "-" if off is None else f"{_shape(off['dim'])} {off['data_type']}" + (
                f" x{mult}" if mult not in (None, 1) else "")
            cells = (role, str(t.get("name")), _shape(t.get("dim")), _shape(t.get("stride")),
                     str(t.get("data_type") or "(graph io)"), ragged)
            table.add_row(*map(safe_markup, cells), "yes" if t.get("is_pass_by_value") else "")
        console.print(table)
        console.print(safe_markup(f"{which} options: " + ", ".join(
            f"{k}={json.dumps(v)}" for k, v in sorted(opts.items()))))  # fmt: skip
    for which, differences in (spec.get("compared") or {}).items():
        if not differences:
            console.print(safe_markup(f"{which}: the same graph as the one in the log"))
        for line in differences:
            console.print(safe_markup(f"{which}: {line}"))


def measured_lines(decision: Decision) -> list[str]:
    """Measured mode's summary (the timings that ordered the candidates, the shape timed) and
    verification's note for what-if devices."""
    m = decision.detail.get("measured")
    lines = [str(decision.detail["numerics_note"])] if decision.detail.get("numerics_note") else []
    if not m:
        return lines
    metric = m.get("metric", "fwd")
    timings = decision.detail.get("timings_ms") or {}
    ranked = sorted(timings, key=lambda n: timings[n].get(metric, float("inf")))
    shown = ", ".join(f"{n} {timings[n][metric]:.3g}" for n in ranked if metric in timings[n])
    lines.append(f"measured ({metric.replace('_', '+')}, ms, median of {m.get('repeats')}): "
                 + shown if shown else "measured mode: nothing could be timed here")  # fmt: skip
    if m.get("note"):
        lines.append(str(m["note"]))
    if m.get("untimed") and shown:
        kept = ", ".join(m["untimed"])
        lines.append(f"not timed here, kept in their rule-priority place: {kept}")
    if m.get("priority_choice") != decision.chosen:
        lines.append(f"rule priority alone would choose: {m.get('priority_choice')}")
    return lines


def summary(decision: Decision) -> dict[str, Any]:
    """A compact dict: chosen backend and one short reason per refused candidate."""
    return {
        "chosen": decision.chosen,
        "flash_variant": decision.detail.get("flash_variant"),
        "refused": {r.backend: r.reasons[0].message for r in decision.results if r.reasons},
    }
