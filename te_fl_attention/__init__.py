"""te-fl-attention: choose, prove, explain and remember TransformerEngine's attention backend.

``import te_fl_attention`` is light: torch, cudnn, triton and rich load only where used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "FusedAttnConfig": ("config", "FusedAttnConfig"),
    "DeviceProfile": ("device", "DeviceProfile"),
    "Reason": ("reasons", "Reason"),
    "ProbeResult": ("reasons", "ProbeResult"),
    "Decision": ("reasons", "Decision"),
    "NoBackendError": ("reasons", "NoBackendError"),
    "Policy": ("policy", "Policy"),
    "prefer": ("policy", "prefer"),
    "Selector": ("selector", "Selector"),
    "select": ("selector", "select"),
    "explain": ("selector", "explain"),
    "profile": ("device", "profile"),
    # TransformerEngine integration (imports torch when first used)
    "load_plugins": ("plugin.te", "load_plugins"),
    "install": ("plugin.te", "install"),
    "uninstall": ("plugin.te", "uninstall"),
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
