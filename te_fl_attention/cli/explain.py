"""``te-fl-attn explain``: which backend TE would run for a config, and why (the config
flags, ``--config`` files and ``--device`` are read here)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import stat
from typing import Any

from ..config import FusedAttnConfig
from .common import EXIT_NO_BACKEND, EXIT_OK

_SKIP_FLAGS = {"max_seqlen_kv"}  # has its own flag below (with --seqlen)
_ASCII_INT = re.compile(r"[+-]?[0-9]{1,40}")
_ASCII_FLOAT = re.compile(r"[+-]?([0-9]{1,40}(\.[0-9]{0,40})?|\.[0-9]{1,40})([eE][+-]?[0-9]{1,4})?")
#: Pairs of flags that set the same field: both given with different values is an error.
CONFLICTS = (("seqlen", "max_seqlen_q"), ("batch", "batch_size"))


def _int_arg(text: str) -> int:
    """An ASCII integer (no other digits, no spaces); its range is the config field's."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (ASCII digits, at most 40)")
    return int(text)


def _float_arg(text: str) -> float:
    """An ASCII decimal number (no nan/inf); its range is the config field's."""
    if not _ASCII_FLOAT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite decimal number")
    return float(text)


def _pair(text: str) -> tuple[int, ...]:
    parts = text.replace(" ", "").split(",")
    if not all(_ASCII_INT.fullmatch(x) for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 128,0")
    return tuple(int(x) for x in parts)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from ..config import field_help

    g = p.add_argument_group("config fields (FusedAttnConfig; override --preset/--config)")
    g.add_argument("--seqlen", type=_int_arg, metavar="N",
                   help="max_seqlen_q and max_seqlen_kv together (--max-seqlen-kv overrides the "
                   f"kv side; not with a different --max-seqlen-q): {field_help('max_seqlen_q')}")
    g.add_argument("--batch", type=_int_arg, metavar="N",
                   help=f"alias of --batch-size (not both, unless equal): "
                   f"{field_help('batch_size')}")  # fmt: skip
    g.add_argument("--max-seqlen-kv", type=_int_arg, default=None, metavar="N",
                   help=field_help("max_seqlen_kv"))
    for f in dataclasses.fields(FusedAttnConfig):
        if f.name in _SKIP_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        text = field_help(f.name).replace("%", "%%")
        if f.name in ("window_size", "alibi_slopes_shape"):
            g.add_argument(flag, type=_pair, default=None, metavar="A,B", help=text)
        elif isinstance(default, bool) or f.type in ("bool", "bool | None"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif isinstance(default, int) or f.type in ("int", "int | None"):
            g.add_argument(flag, type=_int_arg, default=None, metavar="N", help=text)
        elif isinstance(default, float) or f.type in ("float", "float | None"):
            g.add_argument(flag, type=_float_arg, default=None, metavar="X", help=text)
        else:
            g.add_argument(flag, type=str, default=None, metavar="NAME", help=text)


def read_config_file(path: str) -> dict[str, Any]:
    """A ``--config`` file: a regular file of at most ``MAX_CONFIG_BYTES`` holding one JSON
    object (never blocks on a FIFO or a device)."""
    from ..config import MAX_CONFIG_BYTES, parse_json_object

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"--config {path!r}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"--config {path!r} is not a regular file")
        data = fh.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path!r} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path!r} is not UTF-8: {exc}") from None
    return parse_json_object(text, f"--config {path!r}")


def build_config(args: argparse.Namespace) -> FusedAttnConfig:
    """Preset -> --config file -> explicit flags, later ones winning; two flags for the same
    field with different values are an error."""
    from ..presets import preset

    for alias, name in CONFLICTS:
        a, b = getattr(args, alias, None), getattr(args, name, None)
        if a is not None and b is not None and a != b:
            flag_a, flag_b = "--" + alias, "--" + name.replace("_", "-")
            raise ValueError(f"{flag_a} {a} conflicts with {flag_b} {b}: both set {name}; "
                             "give one of them")  # fmt: skip
    kw: dict[str, Any] = {}
    if args.preset:
        kw.update(preset(args.preset, seqlen=args.seqlen, batch=args.batch))
    if args.config:
        kw.update(FusedAttnConfig.from_dict(read_config_file(args.config)).to_dict())
    for f in dataclasses.fields(FusedAttnConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            kw[f.name] = value
    if args.seqlen is not None:
        kw["max_seqlen_q"] = args.seqlen
        if args.max_seqlen_kv is None:
            kw["max_seqlen_kv"] = args.seqlen
    if args.batch is not None:
        kw["batch_size"] = args.batch
    for name in ("window_size", "alibi_slopes_shape"):
        if isinstance(kw.get(name), list):
            kw[name] = tuple(kw[name])
    return FusedAttnConfig(**kw)


def device_arg(value: str | None) -> str:
    """``--device``, else ``TE_FL_ATTN_DEVICE`` (as the plugin reads it), else ``local``;
    checked here so a bad value is exit 2 naming where it came from."""
    from ..device import profile

    if value is not None:
        profile(value)
        return value
    env = os.environ.get("TE_FL_ATTN_DEVICE") or None
    if env is None:
        return "local"
    try:
        profile(env)
    except ValueError as exc:
        raise ValueError(f"TE_FL_ATTN_DEVICE: {exc}") from None
    return env


def _policy(args: argparse.Namespace):
    from ..policy import Policy

    prefer = tuple(p for p in (args.prefer or "").split(",") if p)
    return Policy.from_env(**({"prefer": prefer} if prefer else {}))


def cmd_explain(args: argparse.Namespace) -> int:
    from ..selector import default_selector
    from . import render

    config = build_config(args)
    device = device_arg(args.device)
    policy = _policy(args)
    if args.verify or args.measure:
        policy = policy.with_(verify=policy.verify or args.verify,
                              measure=policy.measure or args.measure)  # fmt: skip
    selector = default_selector()
    decision = selector.decide(config, device, policy, force=args.force)
    decision = render.fit_hints(decision, device)
    if args.show_graph or args.compare_log:
        spec = selector.graph_spec(config, decision.device) or {
            "message": "no graphs: the fused probe builds none here (TE_FL_ATTN_CUDNN_PROBE=0, "
                       "or cudnn-frontend is not installed)"}  # fmt: skip
        if args.compare_log:
            spec["compared"] = compare_with_log(spec, args.compare_log)
        decision = dataclasses.replace(decision, detail={**decision.detail, "graph_spec": spec})
    if args.json:
        print(render.to_json(decision))
    else:
        render.render(decision)
    return EXIT_OK if decision.chosen else EXIT_NO_BACKEND


def compare_with_log(spec: dict, path: str) -> dict[str, list[str]]:
    """Our graphs against the graphs in a cudnn-frontend log (TE's, ``CUDNN_FRONTEND_LOG_INFO=1``
    ``CUDNN_FRONTEND_LOG_FILE=...``): per graph, the differences from the closest one there."""
    from ..graphspec import graphs_in_log, match

    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            logged = graphs_in_log(fh.read())
    except OSError as exc:
        raise ValueError(f"--compare-log {path}: {exc.strerror or exc}") from None
    if not logged:
        raise ValueError(f"--compare-log {path}: no cuDNN graph (JSON with nodes and tensors) "
                         "in it; write one with CUDNN_FRONTEND_LOG_INFO=1 "
                         "CUDNN_FRONTEND_LOG_FILE=<path>")  # fmt: skip
    return {which: match(graph, logged)[1] for which, graph in (spec.get("graphs") or {}).items()}


def add_explain_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``te-fl-attn explain`` on an ``add_subparsers()`` object."""
    from .. import backends
    from ..config import MAX_CONFIG_BYTES
    from ..device import CATALOG
    from ..presets import PRESETS

    e = sub.add_parser("explain", help="which backend TE would run for a config, and why")
    e.add_argument("--preset", help="a model shape (any case): " + ", ".join(PRESETS))
    e.add_argument("--config", metavar="FILE",
                   help="a JSON file holding one object of FusedAttnConfig fields (at most "
                   f"{MAX_CONFIG_BYTES} bytes)")  # fmt: skip
    e.add_argument("--device", default=None,
                   help="local, a catalog name (" + ", ".join(CATALOG) + "), or "
                   "name:field=value,... overrides (e.g. h100:cudnn=9.10.2,fa4=none); default: "
                   "TE_FL_ATTN_DEVICE as the plugin reads it, else local")  # fmt: skip
    e.add_argument("--force", metavar="BACKEND",
                   help="only consider this backend (any case): fused, flash, fa2, fa3, fa4, "
                   "triton, unfused; aliases: " + ", ".join(  # fmt: skip
                       n for n, c in backends.aliases().items() if n != c))
    e.add_argument("--prefer", metavar="B1,B2",
                   help="comma-separated backends to try first (same names as --force)")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.add_argument("--verify", action="store_true",
                   help="compare each candidate that can run here with the reference on a small "
                   "problem of this config (TE_FL_ATTN_VERIFY=1)")  # fmt: skip
    e.add_argument("--measure", action="store_true",
                   help="time each candidate that can run here and choose the fastest "
                   "(TE_FL_ATTN_MEASURE=1; on CPU a scaled-down shape)")  # fmt: skip
    e.add_argument("--show-graph", action="store_true",
                   help="also list the cuDNN graphs FusedAttention's probe builds: every tensor "
                   "(role, dims, strides, data type, ragged offset) and every option, in "
                   "cudnn-frontend's vocabulary")  # fmt: skip
    e.add_argument("--compare-log", metavar="FILE",
                   help="with --show-graph: compare those graphs with the closest ones in a "
                   "cudnn-frontend log (CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=FILE "
                   "while TE runs) and print every difference")  # fmt: skip
    _add_config_flags(e)
    e.set_defaults(func=cmd_explain)
    return e
