"""The ``te-fl-attn cache`` subcommands, as plain functions.

Each ``cmd_*`` function takes simple arguments and a ``print``-like ``out`` and returns an exit
code (0 ok, 1 failed or something was rejected, 2 bad usage). :func:`add_cache_parser` wires them
into an argparse tree; :func:`run_cache_command` runs a parsed namespace. ``rich`` is imported only
to draw tables on a terminal.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import files as _files
from ..cache.keys import is_hex64, known_backends
from ..cache.memory import MemoryCache
from ..cache.rows import CacheRow
from ..cache.sqlite import ProbeCache
from ..cache.tiered import default_cache
from .render import safe_markup, safe_text

Out = Callable[[str], Any]
Cache = ProbeCache | MemoryCache

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"30d"`` -> seconds. Suffixes ``s``, ``m``, ``h``, ``d``; a bare number is seconds."""
    m = _DURATION.fullmatch(str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: expected a number with an optional s/m/h/d suffix (30d)"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


class _Safe:
    """``out`` for lines that carry text from outside (stored rows, a pack's refusal, file
    names): each passes :func:`.render.safe_text`, so no control sequence reaches the terminal
    raw. :func:`_rich` writes its tables (escaped cell by cell) through ``raw``."""

    def __init__(self, raw: Out) -> None:
        self.raw = raw

    def __call__(self, text: str) -> Any:
        return self.raw(safe_text(text))


def _safe(out: Out) -> _Safe:
    return out if isinstance(out, _Safe) else _Safe(out)


def _raw(out: Out) -> Out:
    return out.raw if isinstance(out, _Safe) else out


def _err(out: Out, text: str) -> None:
    """An error line: to stderr when printing (stdout stays the command's output)."""
    if _raw(out) is print:
        print(safe_text(text), file=sys.stderr)
    else:
        _safe(out)(text)


def _is_tty(out: Out, tty: bool | None) -> bool:
    if tty is not None:
        return tty
    return _raw(out) is print and sys.stdout.isatty()


def _table(out: Out, title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
           **column: Any) -> None:
    """``rows`` as a rich table on a terminal; every cell is text from the store (maybe from an
    import), shown as plain text: no markup, no control sequence."""
    from rich.table import Table

    table = Table(title=title)
    for col in header:
        table.add_column(col, **column.get(col, column.get("*", {})))
    for row in rows:
        table.add_row(*map(safe_markup, row))
    _rich(out, table)


def _rich(out: Out, renderable: Any) -> None:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, force_terminal=True, width=shutil.get_terminal_size().columns).print(
        renderable
    )
    _raw(out)(buf.getvalue().rstrip("\n"))


def _when(ts: float) -> str:
    if not ts:
        return "unknown"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _device_label(fp: str, names: Mapping[str, str]) -> str:
    name = names.get(fp)
    return f"{name} [{fp[:8]}]" if name else fp[:12]


def _verdict(result: Mapping[str, Any]) -> str:
    return "supported" if result.get("supported") else "unsupported"


def _reasons_text(result: Mapping[str, Any]) -> str:
    reasons = result.get("reasons") or []
    return "; ".join(str(r.get("code", "?")) for r in reasons if isinstance(r, Mapping))


def _cache(cache: Cache | None) -> Cache:
    return cache if cache is not None else default_cache()


# -------------------------------------------------------------------------------------- commands
def cmd_path(out: Out = print, *, cache: Cache | None = None) -> int:
    """Print the cache file's path (``off`` when persistence is disabled)."""
    out = _safe(out)
    c = _cache(cache)
    out("off (TE_FL_ATTN_CACHE=off: results are kept in memory only)"
        if isinstance(c, MemoryCache) else str(c.path))  # fmt: skip
    return 0


def cmd_stats(out: Out = print, *, as_json: bool = False, tty: bool | None = None,
              cache: Cache | None = None) -> int:  # fmt: skip
    """Counts by backend, device, software stack and verdict."""
    out = _safe(out)
    st = _cache(cache).stats()
    if as_json:
        out(json.dumps(st, indent=2, sort_keys=True))
        return 0
    names = st.get("device_names", {})
    rows: list[tuple[str, str, str]] = [
        ("store", "path", str(st["path"] or "memory only")),
        ("store", "mode", str(st["mode"])),
        ("store", "size", _size(int(st["size_bytes"]))),
        ("store", "entries", str(st["entries"])),
    ]
    rows += [("verdict", k, str(v)) for k, v in st["by_verdict"].items()]
    rows += [("backend", b, str(n)) for b, n in sorted(st["by_backend"].items())]
    rows += [("device", _device_label(fp, names), str(n))
             for fp, n in sorted(st["by_device"].items(), key=lambda kv: -kv[1])]  # fmt: skip
    rows += [("software stack", vk[:12], str(n))
             for vk, n in sorted(st["by_versions_key"].items(), key=lambda kv: -kv[1])]  # fmt: skip
    if _is_tty(out, tty):
        _table(out, "probe cache", ("group", "name", "value"), rows,
               value={"justify": "right"})  # fmt: skip
    else:
        for group, name, value in rows:
            out(f"{group:15s} {name:30s} {value}")
    return 0


def _row_json(row: CacheRow) -> dict[str, Any]:
    d = row.to_dict()
    d["supported"] = bool(row.result.get("supported"))
    return d


def cmd_list(out: Out = print, *, limit: int = 50, backend: str | None = None,
             as_json: bool = False, tty: bool | None = None,
             cache: Cache | None = None) -> int:  # fmt: skip
    """The most recent rows (``limit`` 0: all), newest first."""
    out = _safe(out)
    rows = _cache(cache).recent(limit, backend=backend)
    if as_json:
        out(json.dumps([_row_json(r) for r in rows], indent=2))
        return 0
    names = {r.key.device_fp: str(r.device["name"]) for r in rows
             if r.device and isinstance(r.device.get("name"), str)}  # fmt: skip
    header = ("config", "backend", "device", "verdict", "stage", "stored", "reasons")
    table = [(r.key.config_key[:12], r.key.backend, _device_label(r.key.device_fp, names),
              _verdict(r.result), str(r.result.get("stage", "")), _when(r.created_at),
              _reasons_text(r.result)) for r in rows]  # fmt: skip
    if _is_tty(out, tty):
        _table(out, f"probe cache: {len(rows)} most recent rows", header, table,
               **{"*": {"overflow": "fold"}})  # fmt: skip
    else:
        out("\t".join(header))
        for line in table:
            out("\t".join(line))
    return 0


def _show_result(out: Out, result: Mapping[str, Any], indent: str) -> None:
    out(f"{indent}{result.get('backend')}: {_verdict(result)} (stage {result.get('stage')}, "
        f"evidence {result.get('evidence')}, {result.get('elapsed_ms', 0)} ms)")  # fmt: skip
    for r in result.get("reasons") or []:
        out(f"{indent}  - [{r.get('stage')}] {r.get('code')}: {r.get('message')}")
    if result.get("detail"):
        out(f"{indent}  detail: {json.dumps(result['detail'], sort_keys=True)}")
    for v in result.get("variants") or []:
        _show_result(out, v, indent + "    ")


def cmd_show(key: str, out: Out = print, *, as_json: bool = False,
             cache: Cache | None = None) -> int:  # fmt: skip
    """Every row of one config, by config key or a prefix of at least 8 hex characters."""
    out = _safe(out)
    prefix = key.strip().lower()
    if len(prefix) < 8 or len(prefix) > 64 or not is_hex64(prefix.ljust(64, "0")):
        _err(out, f"error: {key!r} is not a config key or a prefix of at least 8 hex characters")
        return 2
    rows = list(_cache(cache).iter_rows(config_prefix=prefix))
    keys = sorted({r.key.config_key for r in rows})
    if not keys:
        out(f"no cached rows for config key {prefix}")
        return 1
    if len(keys) > 1:
        _err(out, f"error: prefix {prefix} matches {len(keys)} configs; use more characters:")
        for k in keys[:20]:
            out(f"  {k}")
        return 2
    config = next((r.config for r in rows if r.config), None)
    check = _config_check(keys[0], config)
    if as_json:
        out(json.dumps({"config_key": keys[0], "config": config, "config_check": check,
                        "rows": [_row_json(r) for r in rows]}, indent=2))  # fmt: skip
        return 0
    out(f"config {keys[0]}")
    if config is not None:
        out(f"  {json.dumps(config, sort_keys=True)}")
    if check != "ok":
        out(f"  note: {check}")
    for r in rows:
        dev = r.device.get("name") if r.device else None
        out(
            f"row: device {dev or '?'} [{r.key.device_fp[:12]}], software stack "
            f"{r.key.versions_key[:12]}, stored {_when(r.created_at)} by {r.package_version}"
        )
        _show_result(out, r.result, "  ")
    return 0


def _config_check(config_key: str, config: Mapping[str, Any] | None) -> str:
    """Whether the stored config JSON hashes to the key (it is display-only either way)."""
    if config is None:
        return "config JSON not stored"
    from ..config import FusedAttnConfig

    try:
        computed = FusedAttnConfig.from_dict(config).key()
    except (ValueError, TypeError) as exc:
        return f"stored config JSON is not valid for this version: {exc}"
    return "ok" if computed == config_key else "stored config JSON does not hash to this key"


def cmd_export(file: str, out: Out = print, *, device_fp: str | None = None,
               fmt: str = "jsonl", cache: Cache | None = None) -> int:  # fmt: skip
    """Write the cache (or one device's rows) as JSON Lines, or (``fmt="sqlite"``) as an SQLite
    pack, a new file (an existing one is refused)."""
    out = _safe(out)
    from ..cache.pack import export_pack
    from ..cache.transfer import export

    if fmt not in ("jsonl", "sqlite"):
        _err(out, f"error: --format {fmt!r}: expected jsonl or sqlite")
        return 2
    try:
        _files.check_output_path(file, exist_ok=fmt == "jsonl")  # before the work
        c = _cache(cache)
        if fmt == "sqlite":
            n = export_pack(getattr(c, "local", c), file, device_fp=device_fp)
        else:
            n = export(c, file, device_fp=device_fp)
    except _files.OutputPathError as exc:
        _err(out, f"error: {exc}")
        return 1
    except OSError as exc:
        _err(out, f"error: cannot write {file}: {exc}")
        return 1
    out(f"exported {n} rows to {file}")
    return 0


def _report_rejections(out: Out, rejected: Sequence[tuple[Any, ...]]) -> None:
    for item in rejected[:20]:
        *where, reason = item
        out(f"  rejected {':'.join(str(w) for w in where)}: {reason}")
    if len(rejected) > 20:
        out(f"  ... and {len(rejected) - 20} more")


def cmd_import(file: str, out: Out = print, *, as_json: bool = False,
               cache: Cache | None = None) -> int:  # fmt: skip
    """Import an export, a pack (or another store file); never overwrites stored rows."""
    out = _safe(out)
    from ..cache.pack import PackError
    from ..cache.transfer import import_

    c = _cache(cache)
    problem = _not_writable(c)
    if problem:  # checked before reading anything
        _err(out, f"error: cannot import into the probe cache: {problem}; nothing was imported")
        return 1
    try:
        report = import_(c, file)
    except PackError as exc:
        _err(out, f"error: refusing the pack {file}: {exc}; nothing was imported")
        return 1
    except OSError as exc:
        _err(out, f"error: cannot read {file}: {exc.strerror or exc}" if exc.filename
            else f"error: cannot read {file}: {exc}")  # fmt: skip
        return 1
    if as_json:
        out(json.dumps(report.to_dict(), indent=2))
    else:
        out(str(report))
        _report_rejections(out, report.rejected)
    if report.not_written:
        _err(out, f"error: {report.not_written} row(s) could not be written to the probe cache "
            f"({report.problem}); they are not imported")  # fmt: skip
        return 1
    return 1 if report.rejected else 0


def _not_writable(cache: Any, *, check: bool = True) -> str | None:
    """Why rows written to ``cache`` would not reach its file, or ``None`` (opens it;
    ``check``: also run the integrity check, quarantining a damaged store)."""
    store = getattr(cache, "local", cache)
    if isinstance(store, MemoryCache):
        return "it is off (TE_FL_ATTN_CACHE=off keeps results in memory only)"
    if not isinstance(store, ProbeCache):
        return None
    if store.readonly:
        return f"{store.path} is opened read-only (TE_FL_ATTN_CACHE_READONLY=1)"
    if check:
        store.check_integrity()  # a damaged store is moved aside and a new one started
    else:
        len(store)  # open it
    if store.mode != "rw":
        return f"{store.path} cannot be written ({store.problem or store.mode})"
    return None


def cmd_merge(a: str, b: str, output: str, out: Out = print, *, as_json: bool = False) -> int:
    """Merge two exports/stores into a new store (or ``.jsonl``); newer wins on conflict."""
    out = _safe(out)
    from ..cache.transfer import merge

    try:
        report = merge(a, b, output)
    except (OSError, FileExistsError) as exc:
        _err(out, f"error: {exc}")
        return 1
    if as_json:
        out(json.dumps(report.to_dict(), indent=2))
    else:
        out(f"{report} -> {output}")
        _report_rejections(out, report.rejected)
    return 1 if report.rejected else 0


def current_versions_keys() -> frozenset[str]:
    """The versions keys the default selector writes now: local machine and catalog profiles,
    probe rows and the verify/measure stages' rows."""
    from ..device import CATALOG, local
    from ..selector import default_selector

    space = default_selector().keys
    return frozenset(space.versions(d, stage) for d in (local(), *CATALOG.values())
                     for stage in (None, "verify", "measure"))  # fmt: skip


def cmd_prune(out: Out = print, *, older_than: float | None = None,
              not_version: str | None = None, cache: Cache | None = None) -> int:  # fmt: skip
    """Delete rows older than ``older_than`` seconds and/or from another software stack.

    ``not_version``: a versions key, or ``current``: the keys this installation writes now for
    the local machine and for every catalog profile (as defined now).
    """
    out = _safe(out)
    if older_than is None and not_version is None:
        _err(out, "error: give --older-than DURATION and/or --not-version current|KEY")
        return 2
    keep = None
    if not_version is not None:
        if not_version == "current":
            keep = current_versions_keys()
        elif is_hex64(not_version.lower()):
            keep = not_version.lower()
        else:
            _err(out, f"error: --not-version {not_version!r}: expected 'current' or a 64-hex key")
            return 2
    c = _cache(cache)
    problem = _not_writable(c, check=False)
    if problem:
        _err(out, f"error: cannot prune the probe cache: {problem}; nothing was deleted")
        return 1
    n = c.prune(older_than_s=older_than, not_versions_key=keep)
    problem = _not_writable(c, check=False)
    if problem:
        _err(out, f"error: pruning failed: {problem}")
        return 1
    out(f"pruned {n} rows")
    return 0


def cmd_clear(out: Out = print, *, yes: bool = False, cache: Cache | None = None) -> int:
    """Delete every row (needs ``yes``)."""
    out = _safe(out)
    c = _cache(cache)
    if not yes:
        out(f"refusing to clear {len(c)} rows without --yes")
        return 2
    problem = _not_writable(c, check=False)
    if problem:
        _err(out, f"error: cannot clear the probe cache: {problem}; nothing was deleted")
        return 1
    n = c.clear()
    problem = _not_writable(c, check=False)
    if problem:
        _err(out, f"error: clearing failed: {problem}")
        return 1
    out(f"cleared {n} rows")
    return 0


# ---------------------------------------------------------------------------------------- argparse
def add_cache_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cache`` and its subcommands; sets ``func=run_cache_command`` on the namespace."""
    p = subparsers.add_parser(
        "cache",
        help="inspect and manage the probe cache",
        description="Inspect and manage the persistent probe cache.",
    )
    sub = p.add_subparsers(dest="cache_command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("path", help="print the cache file's path")
    s = sub.add_parser("stats", help="counts by backend, device, software stack and verdict")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    ls = sub.add_parser("list", help="the most recent rows")
    ls.add_argument("--limit", type=int, default=50, help="rows to show (0: all; default 50)")
    ls.add_argument("--backend", choices=known_backends(), help="only this backend")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    sh = sub.add_parser("show", help="every row of one config")
    sh.add_argument("key", help="config key, or a prefix of at least 8 hex characters")
    sh.add_argument("--json", action="store_true", help="machine-readable output")
    ex = sub.add_parser("export", help="write the cache as JSON Lines or an SQLite pack")
    ex.add_argument("file")
    ex.add_argument("--format", choices=("jsonl", "sqlite"), default="jsonl",
                    help="jsonl (default: for people and diffs) or sqlite (a pack: moves rows "
                    "between stores fast; a new file)")  # fmt: skip
    ex.add_argument("--device-fp", help="only rows of this device fingerprint")
    im = sub.add_parser("import", help="import an export, a pack or a store (never overwrites)")
    im.add_argument("file")
    im.add_argument("--json", action="store_true", help="machine-readable report")
    mg = sub.add_parser("merge", help="merge two exports, packs or stores into a new one")
    mg.add_argument("a")
    mg.add_argument("b")
    mg.add_argument("-o", "--output", required=True, help="new store (or .jsonl export)")
    mg.add_argument("--json", action="store_true", help="machine-readable report")
    pr = sub.add_parser("prune", help="delete old rows or rows of other software stacks")
    pr.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                    help="e.g. 3600s, 90m, 12h, 30d")  # fmt: skip
    pr.add_argument(
        "--not-version",
        metavar="current|KEY",
        help="delete rows not from this versions key ('current': what this installation "
        "writes now for the local machine and the catalog GPUs)",
    )
    cl = sub.add_parser("clear", help="delete every row")
    cl.add_argument("--yes", action="store_true", help="really delete everything")
    p.set_defaults(func=run_cache_command)
    return p


def run_cache_command(args: argparse.Namespace, out: Out = print) -> int:
    """Run the subcommand in a namespace parsed by :func:`add_cache_parser`'s parser."""
    cmd = args.cache_command
    as_json = bool(getattr(args, "json", False))
    if cmd == "path":
        return cmd_path(out)
    if cmd == "stats":
        return cmd_stats(out, as_json=as_json)
    if cmd == "list":
        return cmd_list(out, limit=args.limit, backend=args.backend, as_json=as_json)
    if cmd == "show":
        return cmd_show(args.key, out, as_json=as_json)
    if cmd == "export":
        return cmd_export(args.file, out, device_fp=args.device_fp,
                          fmt=getattr(args, "format", "jsonl"))
    if cmd == "import":
        return cmd_import(args.file, out, as_json=as_json)
    if cmd == "merge":
        return cmd_merge(args.a, args.b, args.output, out, as_json=as_json)
    if cmd == "prune":
        return cmd_prune(out, older_than=args.older_than, not_version=args.not_version)
    if cmd == "clear":
        return cmd_clear(out, yes=args.yes)
    _err(out, f"error: unknown cache command {cmd!r}")
    return 2
