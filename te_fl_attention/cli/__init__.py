"""te-fl-attn: explain which attention backend TransformerEngine would run for a config and
why, show device profiles, print the support matrix (rule stage), manage the probe cache and
compare a fleet.

Exit codes: 0 a backend was chosen (or the command worked), 3 no backend, 2 bad input.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .common import EXIT_BAD_INPUT, EXIT_NO_BACKEND, EXIT_OK, run_parser

__all__ = ["EXIT_BAD_INPUT", "EXIT_NO_BACKEND", "EXIT_OK", "main", "parser", "run_parser"]


def parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="te-fl-attn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"te-fl-attn {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    from .device import add_device_parser
    from .explain import add_explain_parser
    from .matrix import add_matrix_parser

    add_explain_parser(sub)
    add_device_parser(sub)
    add_matrix_parser(sub)
    try:
        from .cache import add_cache_parser
    except ImportError:  # pragma: no cover - the cache package ships with the package
        pass
    else:
        add_cache_parser(sub)
    from .fleet import add_fleet_parser

    add_fleet_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_parser(parser(), argv)
