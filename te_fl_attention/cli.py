"""``te-fl-attn``: explain a decision, show device profiles, print the support matrix, manage
the probe cache.

Exit codes: 0 a backend was chosen (or the command worked), 3 no backend, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from .config import FusedAttnConfig

EXIT_OK, EXIT_BAD_INPUT, EXIT_NO_BACKEND = 0, 2, 3

_SKIP_FLAGS = {"max_seqlen_kv"}  # has its own flag below (with --seqlen)


def _pair(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 128,0") from None


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("config fields (FusedAttnConfig; override --preset/--config)")
    g.add_argument("--seqlen", type=int, help="max_seqlen_q and max_seqlen_kv together")
    g.add_argument("--batch", type=int, help="alias of --batch-size")
    g.add_argument("--max-seqlen-kv", type=int, default=None)
    for f in dataclasses.fields(FusedAttnConfig):
        if f.name in _SKIP_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.name in ("window_size", "alibi_slopes_shape"):
            g.add_argument(flag, type=_pair, default=None, metavar="A,B")
        elif isinstance(default, bool) or f.type in ("bool", "bool | None"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif isinstance(default, int) or f.type in ("int", "int | None"):
            g.add_argument(flag, type=int, default=None)
        elif isinstance(default, float) or f.type in ("float", "float | None"):
            g.add_argument(flag, type=float, default=None)
        else:
            g.add_argument(flag, type=str, default=None)


def build_config(args: argparse.Namespace) -> FusedAttnConfig:
    """Preset -> --config file -> explicit flags, later ones winning."""
    from .presets import preset

    kw: dict[str, Any] = {}
    if args.preset:
        kw.update(preset(args.preset, seqlen=args.seqlen, batch=args.batch))
    if args.config:
        try:
            with open(args.config) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--config {args.config}: {exc}") from None
        kw.update(FusedAttnConfig.from_dict(data).to_dict() if isinstance(data, dict) else data)
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


def _policy(args: argparse.Namespace):
    from .policy import Policy

    prefer = tuple(p for p in (args.prefer or "").split(",") if p)
    return Policy.from_env(**({"prefer": prefer} if prefer else {}))


def cmd_explain(args: argparse.Namespace) -> int:
    from . import render
    from .selector import default_selector

    config = build_config(args)
    policy = _policy(args)
    if args.verify or args.measure:
        policy = policy.with_(verify=policy.verify or args.verify,
                              measure=policy.measure or args.measure)  # fmt: skip
    selector = default_selector()
    decision = selector.decide(config, args.device, policy, force=args.force)
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


def cmd_device(args: argparse.Namespace) -> int:
    from .device import CATALOG, profile

    if args.name == "capture":
        return cmd_capture(args)
    if args.list:
        for name, dev in CATALOG.items():
            print(f"{name:10s} sm{dev.sm}  {dev.sm_count} SMs  {dev.memory_gib:g} GiB")
        return EXIT_OK
    dev = profile(args.name)
    if args.json:
        print(json.dumps({**dev.to_dict(), "fingerprint": dev.fingerprint(),
                          "versions_key": dev.versions_key()}, indent=2))  # fmt: skip
        return EXIT_OK
    for key, value in dev.to_dict().items():
        print(f"{key:20s} {value if value is not None else 'unknown / not installed'}")
    print(f"{'fingerprint':20s} {dev.fingerprint()[:16]}")
    return EXIT_OK


def cmd_capture(args: argparse.Namespace) -> int:
    """Write the local GPU's real cuDNN device descriptor; ``--install NAME`` makes it replace
    the typed catalog descriptor of NAME."""
    from .descriptors import DescriptorError, capture_local_descriptor, install_captured

    try:
        desc = capture_local_descriptor()
    except DescriptorError as exc:
        raise ValueError(f"device capture: {exc}") from None
    text = json.dumps(desc, indent=2, sort_keys=True)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    if args.install:
        print(f"installed as {install_captured(args.install, desc)}", file=sys.stderr)
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from .matrix import markdown

    print(markdown(), end="")
    return EXIT_OK


def compare_with_log(spec: dict, path: str) -> dict[str, list[str]]:
    """Our graphs against the graphs in a cudnn-frontend log (TE's, ``CUDNN_FRONTEND_LOG_INFO=1``
    ``CUDNN_FRONTEND_LOG_FILE=...``): per graph, the differences from the closest one there."""
    from .graphspec import graphs_in_log, match

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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="te-fl-attn", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("explain", help="which backend TE would run for a config, and why")
    e.add_argument("--preset", help="a model shape: llama3-8b, llama3-70b, mixtral-8x7b, "
                   "deepseek-v3, gpt-oss-120b-swa")  # fmt: skip
    e.add_argument("--config", help="a JSON file with FusedAttnConfig fields")
    e.add_argument("--device", default="local",
                   help="local, a catalog name (h100), or name:field=value,... overrides")
    e.add_argument("--force", help="only consider this backend (error if unsupported)")
    e.add_argument("--prefer", help="comma-separated backends to try first")
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

    d = sub.add_parser("device", help="print a device profile (local or a catalog name); "
                       "'device capture' writes the local GPU's cuDNN descriptor")  # fmt: skip
    d.add_argument("name", nargs="?", default="local", help="local, a catalog name, or capture")
    d.add_argument("-o", "--output", help="capture: write the descriptor here")
    d.add_argument("--install", metavar="NAME",
                   help="capture: replace catalog GPU NAME's typed descriptor with it")
    d.add_argument("--json", action="store_true")
    d.add_argument("--list", action="store_true", help="list the catalog")
    d.set_defaults(func=cmd_device)

    m = sub.add_parser("matrix", help="print the support matrix (markdown)")
    m.set_defaults(func=cmd_matrix)

    try:
        from .cache.commands import add_cache_parser
    except ImportError:  # pragma: no cover - the cache package ships with the package
        pass
    else:
        add_cache_parser(sub)
    from .fleet_cli import add_fleet_parser

    add_fleet_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_parser(parser(), argv)


def run_parser(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command: ValueError is bad input (exit 2)."""
    args = p.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"te-fl-attn: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
