"""A fleet plan as one self-contained HTML page: no network, inline CSS and JS.

The matrix is colour-coded by chosen backend; hovering a cell shows the refusals, clicking it
expands every candidate's verdict and reasons. A summary and, optionally, the uniform choice per
config (the best backend supported on every device) sit above and beside the matrix.
"""

from __future__ import annotations

import datetime as _dt
import html
import os
from typing import TYPE_CHECKING

from .. import backends
from ..policy import Policy
from .labels import describe, device_type
from .plan import VERIFIED, Cell, FleetPlan
from .uniform import Uniform

if TYPE_CHECKING:
    from ..reasons import ProbeResult

_NONE = ("#b3261e", "#fbe1df")  # no backend: (accent, background)


def _colours() -> dict[str, tuple[str, str]]:
    """Backend -> (accent, background), from the registry (``Backend.colours``), then none."""
    return {**{b.name: b.colours for b in backends.all_backends()}, "none": _NONE}

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d1d1f}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:20px 0 8px}
.meta{color:#666;margin:0 0 12px}.summary li{margin:2px 0}
.legend{display:flex;flex-wrap:wrap;gap:12px;margin:8px 0 12px;align-items:center}
.sw{display:inline-block;width:14px;height:14px;border-radius:3px;vertical-align:-2px;
margin-right:4px}
.controls{margin:8px 0}
.controls button,.controls input{font:inherit;padding:3px 8px;margin-right:6px}
table{border-collapse:separate;border-spacing:4px}
th{text-align:left;font-weight:600;vertical-align:top;padding:4px 8px}
thead th small{display:block;font-weight:400;color:#666}
th.cfg .desc{font-weight:400;color:#666;font-size:12px}
td.cell{vertical-align:top;min-width:140px;max-width:230px;padding:6px 8px;border-radius:6px;
border:2px solid var(--acc);background:var(--bg)}
td.cell.predicted{border-style:dashed}
td.cell summary{cursor:pointer;list-style:none}
td.cell summary::-webkit-details-marker{display:none}
.choice{font-weight:600;color:var(--acc)}
.badge{display:inline-block;margin-left:6px;font-size:11px;padding:0 6px;border-radius:8px;
border:1px solid var(--acc);color:var(--acc)}
.verified .badge{background:var(--acc);color:#fff}
.refused{margin:2px 0 0;padding:0;list-style:none;font-size:11px;color:#444}
.cands{margin:6px 0 0;padding-left:16px;font-size:12px}.cands li{margin:3px 0}
.cands .ok{color:#1b7f3b}.cands .no{color:#8a1c14}.cands .chosen{font-weight:600}
.hint{color:#555;font-style:italic}.ev{font-size:11px;color:#555;margin:4px 0 0}
tr.hidden{display:none}
"""

_JS = """
document.getElementById('expand').onclick=()=>document.querySelectorAll('td.cell details')
  .forEach(d=>d.open=true);
document.getElementById('collapse').onclick=()=>document.querySelectorAll('td.cell details')
  .forEach(d=>d.open=false);
document.getElementById('filter').oninput=e=>{const q=e.target.value.toLowerCase();
  document.querySelectorAll('#matrix tbody tr').forEach(r=>r.classList.toggle('hidden',
  !r.textContent.toLowerCase().includes(q)));};
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _style(backend: str | None) -> str:
    acc, bg = _colours().get(backend or "none", _NONE)
    return f"--acc:{acc};--bg:{bg}"


def _reasons_html(r: ProbeResult) -> str:
    items = []
    for x in r.reasons:
        msg = x.message if len(x.message) <= 400 else x.message[:399] + "\u2026"
        hint = f' <span class="hint">hint: {_e(x.hint)}</span>' if x.hint else ""
        items.append(f"[{_e(x.stage)}] {_e(msg)}{hint}")
    return "; ".join(items)


def _cell(c: Cell) -> str:
    d = c.decision
    refusals = c.refusals()
    tip = "\n".join(f"{backends.display(b)}: {why}" for b, why in refusals) or "all supported"
    short = "".join(f"<li>\u2717 {_e(b)}: {_e(why)}</li>" for b, why in refusals)
    cands = []
    for r in d.results:
        chosen = r.backend == d.chosen
        verdict = "chosen" if chosen else ("supported, ranked lower" if r.supported else "refused")
        extra = f" ({_e(r.stage)}: {_e(r.evidence)})" if r.evidence != "rules" else ""
        body = _reasons_html(r)
        cls = ("ok" if r.supported else "no") + (" chosen" if chosen else "")
        cands.append(f'<li class="{cls}">{_e(r.display_name)}: {verdict}{extra}'
                     + (f"<br>{body}" if body else "") + "</li>")  # fmt: skip
    mark = "\u2713 " if c.status == VERIFIED else "~ "
    return (
        f'<td class="cell {c.status}" style="{_style(d.chosen)}" data-backend='
        f'"{_e(d.chosen or "none")}" data-status="{c.status}" title="{_e(tip)}">'
        f'<details><summary><span class="choice">{_e(c.label)}</span>'
        f'<span class="badge">{mark}{c.status}</span>'
        f'<ul class="refused">{short}</ul></summary><ul class="cands">{"".join(cands)}</ul>'
        f'<p class="ev">{_e(c.evidence)} \u00b7 order {_e(" > ".join(d.order))}</p>'
        "</details></td>"
    )


def _uniform_cell(u: Uniform) -> str:
    tip = "\n".join(u.why)
    why = "".join(f"<li>{_e(w)}</li>" for w in u.why)
    return (f'<td class="cell uniform" style="{_style(u.chosen)}" data-backend='
            f'"{_e(u.chosen or "none")}" title="{_e(tip)}"><details><summary><span '
            f'class="choice">{_e(u.label)}</span><span class="badge">on every device</span>'
            f'</summary><ul class="cands">{why}</ul></details></td>')  # fmt: skip


def render_html(plan: FleetPlan, *, uniform: bool = False, title: str | None = None) -> str:
    """The whole page as a string."""
    from .. import __version__

    title = title or "Attention backends across the fleet"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    default = Policy().to_dict()
    pol = {k: v for k, v in plan.policy.to_dict().items() if v != default[k]}
    heads = []
    for label, dev in plan.devices:
        sm = f"sm{dev.sm}" if dev.sm is not None else "no GPU"
        kind = device_type(dev)
        sub = f"{sm} \u00b7 cuDNN {dev.cudnn or 'unknown'}" + (f" \u00b7 {kind}" if kind != label
                                                               else "")  # fmt: skip
        heads.append(f"<th>{_e(label)}<small>{_e(sub)}</small></th>")
    if uniform:
        heads.append("<th>uniform<small>best on every device</small></th>")
    unif = plan.uniform() if uniform else {}
    rows = []
    for name, config in plan.configs:
        cells = "".join(_cell(plan.cells[name, label]) for label, _ in plan.devices)
        if uniform:
            cells += _uniform_cell(unif[name])
        rows.append(f'<tr data-config="{_e(name)}"><th class="cfg" scope="row">{_e(name)}'
                    f'<div class="desc">{_e(describe(config))}</div></th>{cells}</tr>')  # fmt: skip
    legend = "".join(f'<span><span class="sw" style="background:{acc}"></span>'
                     f"{_e(backends.display_names().get(b, 'no backend'))}</span>"
                     for b, (acc, _) in _colours().items())  # fmt: skip
    legend += ('<span><span class="badge" style="--acc:#333;background:#333;color:#fff">'
               "\u2713 verified</span> probed on a real GPU of that type</span>"
               '<span><span class="badge" style="--acc:#333">~ predicted</span> rules + '
               "deviceless cuDNN (dashed border)</span>")  # fmt: skip
    summary = "".join(f"<li>{_e(s)}</li>" for s in plan.summary())
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_CSS}'
        f"</style></head><body><h1>{_e(title)}</h1><p class=\"meta\">{len(plan.configs)} "
        f"configs \u00d7 {len(plan.devices)} devices \u00b7 te-fl-attention {__version__} "
        f"\u00b7 {stamp}" + (f" \u00b7 policy {_e(pol)}" if pol else "") + "</p>"
        f'<h2>Summary</h2><ul class="summary">{summary}</ul>'
        f'<div class="legend">{legend}</div><div class="controls"><button id="expand">Expand '
        'all</button><button id="collapse">Collapse all</button><input id="filter" '
        'placeholder="filter configs\u2026"></div>'
        f'<table id="matrix"><thead><tr><th>config</th>{"".join(heads)}</tr></thead><tbody>'
        f'{"".join(rows)}</tbody></table><script>{_JS}</script></body></html>\n'
    )


def write_html(plan: FleetPlan, path: str | os.PathLike[str], *, uniform: bool = False) -> None:
    """Write :func:`render_html` to ``path`` (UTF-8): to a temporary file in the same directory,
    flushed and renamed into place, so a failure leaves no partial report."""
    from ..files import write_text_atomic

    write_text_atomic(path, render_html(plan, uniform=uniform))
