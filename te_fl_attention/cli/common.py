"""What every ``te-fl-attn`` command shares: the exit codes and running a parsed command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_BAD_INPUT, EXIT_NO_BACKEND = 0, 2, 3


def run_parser(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command: ValueError is bad input (exit 2)."""
    args = p.parse_args(argv)
    try:
        from ..switches import check_switches

        check_switches()
        return int(args.func(args))
    except ValueError as exc:
        from .render import safe_text

        print(f"te-fl-attn: error: {safe_text(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return EXIT_OK

