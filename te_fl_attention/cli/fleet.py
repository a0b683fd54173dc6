"""``te-fl-attn fleet``: configs x device types, verified or predicted, as a table, JSON or HTML.

Exit codes: 0 every config has a backend on every device (with ``--uniform``: one supported
everywhere), 3 otherwise, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .. import backends
from ..config import FusedAttnConfig
from .common import EXIT_NO_BACKEND, EXIT_OK

EXIT_WRITE_FAILED = 1  # the --html report could not be written (nothing partial is left)
DEFAULT_DEVICES = "a100,h100,h200,b200"


def parse_devices(values: Sequence[str] | None) -> list[str]:
    """``["a100,h100:cudnn=9.10.2,fa2=none,b200"]`` -> ``["a100", "h100:cudnn=9.10.2,fa2=none",
    "b200"]``: a ``field=value`` item without a ``:`` continues the previous device's overrides."""
    specs: list[str] = []
    for value in values or [DEFAULT_DEVICES]:
        for item in filter(None, (p.strip() for p in value.split(","))):
            if "=" in item and ":" not in item:
                if not specs:
                    raise ValueError(f"--devices: override {item!r} follows no device name")
                specs[-1] += "," + item
            else:
                specs.append(item)
    if not specs:
        raise ValueError("--devices: no device named")
    return specs


def _config(entry: Any, where: str, seqlen: int | None, batch: int | None) -> FusedAttnConfig:
    from ..presets import preset

    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with FusedAttnConfig fields")
    kw = dict(entry)
    kw.pop("name", None)
    name = kw.pop("preset", None)
    base = preset(name, seqlen=seqlen, batch=batch) if name else {}
    if not name and seqlen is not None:
        kw.setdefault("max_seqlen_q", seqlen)
        kw.setdefault("max_seqlen_kv", seqlen)
    if not name and batch is not None:
        kw.setdefault("batch_size", batch)
    try:
        return FusedAttnConfig.from_dict({**base, **kw})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_configs(path: str | None, presets: Sequence[str], seqlen: int | None = None,
                 batch: int | None = None) -> list[tuple[str, FusedAttnConfig]]:  # fmt: skip
    """Named configs from ``--preset`` names and a ``--configs`` file: a JSON list of config
    objects, a JSON object ``{name: config}``, or JSON Lines. An entry may name a ``preset`` and
    override fields; ``name`` labels it. ``seqlen``/``batch`` apply where an entry is silent."""
    from ..fleet import describe

    out: list[tuple[str, FusedAttnConfig]] = []
    for name in presets:
        out.append((name, _config({"preset": name}, f"--preset {name}", seqlen, batch)))
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ValueError(f"--configs {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:
                data = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as exc:
                raise ValueError(f"--configs {path}: not JSON or JSON Lines ({exc})") from None
        if isinstance(data, dict):
            items = [(str(k), v) for k, v in data.items()]
        elif isinstance(data, list):
            items = [(None, v) for v in data]
        else:
            raise ValueError(f"--configs {path}: expected a list or an object of configs")
        for i, (key, entry) in enumerate(items):
            config = _config(entry, f"--configs {path} entry {key or i + 1}", seqlen, batch)
            label = key or (entry.get("name") if isinstance(entry, dict) else None) \
                or entry.get("preset") or describe(config)  # fmt: skip
            out.append((str(label), config))
    if not out:
        raise ValueError("name configs with --configs FILE and/or --preset NAME ...")
    return out


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[], None] | None]:
    """A rich progress bar on stderr while probing (only on a terminal)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("probing"), BarColumn(), MofNCompleteColumn(),
                  console=Console(file=sys.stderr), transient=True) as bar:  # fmt: skip
        task = bar.add_task("fleet", total=total)
        yield lambda: bar.advance(task)


def _render(plan: Any, uniform: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..fleet import VERIFIED, clip

    out = sys.stdout
    console = Console(file=out, width=None if out.isatty() else 200, soft_wrap=False)
    table = Table(title="Attention backend per config and device", show_lines=True)
    table.add_column("config", overflow="fold")
    for label, _ in plan.devices:
        table.add_column(label, overflow="fold")
    styles: dict[str | None, str] = {b.name: b.style for b in backends.all_backends()}
    styles[None] = "red"
    unif = plan.uniform() if uniform else {}
    if uniform:
        table.add_column("uniform", overflow="fold")
    for name, _ in plan.configs:
        row = [escape(name)]
        for label, _ in plan.devices:
            c = plan.cells[name, label]
            mark = "verified" if c.status == VERIFIED else "predicted"
            lines = [f"[bold {styles[c.chosen]}]{escape(c.label)}[/] [dim]({mark})[/]"]
            lines += [f"[dim]x {escape(b)}: {escape(clip(w, 90))}[/]" for b, w in c.refusals()]
            row.append("\n".join(lines))
        if uniform:
            u = unif[name]
            row.append(f"[bold {styles[u.chosen]}]{escape(u.label)}[/]")
        table.add_row(*row)
    console.print(table)
    for line in plan.summary():
        console.print(f"- {escape(line)}")
    if uniform:
        for name, u in unif.items():
            console.print(f"[bold]{escape(name)}[/] uniform: {escape(u.label)}")
            for why in u.why:
                console.print(f"    {escape(clip(why, 300))}")


def cmd_fleet(args: argparse.Namespace) -> int:
    from ..fleet import plan
    from ..policy import Policy

    if args.html:  # checked before the work: a bad path is an error now, not after planning
        from ..files import OutputPathError, check_output_path

        try:
            check_output_path(args.html)
        except OutputPathError as exc:
            raise ValueError(f"--html: {exc}") from None
    configs = load_configs(args.configs, args.preset or [], args.seqlen, args.batch)
    devices = parse_devices(args.devices)
    prefer = tuple(p for p in (args.prefer or "").split(",") if p)
    policy = Policy.from_env(**({"prefer": prefer} if prefer else {}))
    with _progress(len(configs) * len(devices), sys.stderr.isatty() and not args.json) as tick:
        result = plan(configs, devices, policy=policy, progress=tick)
    if args.html:
        from ..fleet.report import write_html

        try:
            write_html(result, args.html, uniform=args.uniform)
        except OSError as exc:
            print(f"te-fl-attn: error: cannot write {args.html}: {exc.strerror or exc}",
                  file=sys.stderr)  # fmt: skip
            return EXIT_WRITE_FAILED
    if args.json:
        print(json.dumps(result.to_dict(uniform=args.uniform), indent=2))
    else:
        _render(result, args.uniform)
        if args.html:
            print(f"wrote {args.html}", file=sys.stderr)
    if args.uniform:
        ok = all(u.chosen is not None for u in result.uniform().values())
    else:
        ok = all(c.chosen is not None for c in result.cells.values())
    return EXIT_OK if ok else EXIT_NO_BACKEND


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", metavar="FILE",
                   help="JSON list / {name: config} / JSON Lines of FusedAttnConfig fields "
                   "(an entry may name a 'preset' and override fields)")  # fmt: skip
    p.add_argument("--preset", nargs="+", action="extend", metavar="NAME",
                   help="model shapes: llama3-8b, llama3-70b, mixtral-8x7b, deepseek-v3, "
                   "gpt-oss-120b-swa")  # fmt: skip
    p.add_argument("--devices", action="append", metavar="LIST",
                   help=f"comma-separated device types (default {DEFAULT_DEVICES}); local; "
                   "NAME:field=value,... overrides")  # fmt: skip
    p.add_argument("--seqlen", type=int, help="max_seqlen_q and max_seqlen_kv of every config")
    p.add_argument("--batch", type=int, help="batch size of every config")
    p.add_argument("--prefer", help="comma-separated backends to try first")
    p.add_argument("--uniform", action="store_true",
                   help="also the best backend supported on every device, per config")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.set_defaults(func=cmd_fleet)


def add_fleet_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``te-fl-attn fleet`` on an ``add_subparsers()`` object."""
    p = subparsers.add_parser("fleet", help="the backend of every config on every device "
                              "type (verified or predicted); --html, --uniform")  # fmt: skip
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m te_fl_attention.cli.fleet ...`` (the same as ``te-fl-attn fleet ...``)."""
    from .common import run_parser

    p = argparse.ArgumentParser(prog="te-fl-attn fleet", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_parser(p, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
