"""``te-fl-attn device``: device profiles (local, catalog) and ``device capture``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import EXIT_OK


def cmd_device(args: argparse.Namespace) -> int:
    from ..device import CATALOG, profile

    if args.name == "capture":
        return cmd_capture(args)
    if args.list:
        if args.json:
            print(json.dumps([{"name": name, "sm": dev.sm, "sm_count": dev.sm_count,
                               "memory_gib": dev.memory_gib} for name, dev in CATALOG.items()],
                             indent=2, allow_nan=False))  # fmt: skip
            return EXIT_OK
        for name, dev in CATALOG.items():
            print(f"{name:10s} sm{dev.sm}  {dev.sm_count} SMs  {dev.memory_gib:g} GiB")
        return EXIT_OK
    dev = profile(args.name)
    if args.json:
        from ..selector import default_key_space

        print(json.dumps({**dev.to_dict(), "fingerprint": dev.fingerprint(),
                          "versions_key": default_key_space().versions(dev)},
                         indent=2))  # fmt: skip
        return EXIT_OK
    for key, value in dev.to_dict().items():
        print(f"{key:20s} {value if value is not None else 'unknown / not installed'}")
    print(f"{'fingerprint':20s} {dev.fingerprint()[:16]}")
    return EXIT_OK


def cmd_capture(args: argparse.Namespace) -> int:
    """Write the local GPU's real cuDNN device descriptor; ``--install NAME`` makes it replace
    the typed catalog descriptor of NAME."""
    from ..descriptors import DescriptorError, capture_local_descriptor, install_captured

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


def add_device_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``te-fl-attn device`` on an ``add_subparsers()`` object."""
    d = sub.add_parser("device", help="print a device profile (local or a catalog name); "
                       "'device capture' writes the local GPU's cuDNN descriptor")  # fmt: skip
    d.add_argument("name", nargs="?", default="local", help="local, a catalog name, or capture")
    d.add_argument("-o", "--output", help="capture: write the descriptor here")
    d.add_argument("--install", metavar="NAME",
                   help="capture: replace catalog GPU NAME's typed descriptor with it")
    d.add_argument("--json", action="store_true")
    d.add_argument("--list", action="store_true", help="list the catalog")
    d.set_defaults(func=cmd_device)
    return d
