"""Plugin discovery: ``te_fl.plugin`` entry points and ``TE_FL_PLUGIN_MODULES``."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .env import split
from .log import logger
from .registry import OpRegistry

ENTRY_POINT_GROUP = "te_fl.plugin"


@dataclass(frozen=True)
class PluginRecord:
    """Outcome of loading one plugin."""

    name: str
    source: str  # "entry_point" or "env"
    ok: bool
    error: str | None = None


def _register_fn(obj: Any) -> Callable[[OpRegistry], Any]:
    if callable(obj) and not isinstance(obj, type):
        return obj
    for attr in ("te_fl_register", "register"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn
    raise TypeError(f"{obj!r} is not callable and has no register(registry) function")


def _run_plugin(
    name: str, source: str, load: Callable[[], Any], registry: OpRegistry
) -> PluginRecord:
    try:
        _register_fn(load())(registry)
    except Exception as exc:  # a broken plugin must not abort plugin loading
        logger.warning("Plugin %r (%s) failed to register: %r", name, source, exc)
        return PluginRecord(name, source, False, repr(exc))
    logger.debug("Plugin %r (%s) registered", name, source)
    return PluginRecord(name, source, True)


def _entry_points() -> list[Any]:
    import importlib.metadata

    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def discover_plugins(
    registry: OpRegistry, environ: Mapping[str, str] | None = None
) -> list[PluginRecord]:
    """Call ``register(registry)`` of each ``te_fl.plugin`` entry point, then of each module in
    ``TE_FL_PLUGIN_MODULES`` (in order). Failures are logged and recorded, not raised."""
    env = os.environ if environ is None else environ
    records = [_run_plugin(ep.name, "entry_point", ep.load, registry) for ep in _entry_points()]
    for name in split(env.get("TE_FL_PLUGIN_MODULES", "")):
        load = lambda n=name: importlib.import_module(n)  # noqa: E731 (binds the loop value)
        records.append(_run_plugin(name, "env", load, registry))
    return records
