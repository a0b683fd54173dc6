"""TransformerEngine's ``NVTE_PLUGIN`` hook: :func:`load_plugins`, the proxy
``transformer_engine_torch``, and :func:`install` / :func:`uninstall` for a TE without the hook.

With ``NVTE_PLUGIN=te_fl_attention`` TE (2.20.2+, or any build carrying PR #3401) loads its
compiled extension, registers it as ``transformer_engine_torch_nv``, imports this package and
calls :func:`load_plugins`. That puts a :class:`TexProxy` in
``sys.modules["transformer_engine_torch"]``; when TE's ``dot_product_attention`` module is
imported it binds

* ``dpa_utils.get_attention_backend`` to :func:`get_attention_backend` (:mod:`.te_backend`: TE's
  6-tuple; TE's own function stays as ``dpa_utils._original_get_attention_backend``), and
* its ``FlashAttention`` name to our router (:mod:`.router`), which runs the flash-tier
  backend the decision chose: flash-attn through TE's own FlashAttention, or our Triton kernel.

Every other attribute resolves through the op registry (:mod:`.ops`: ``TE_FL_*`` policy,
``te_fl.plugin`` entry points, ``TE_FL_PLUGIN_MODULES``), falling through to the native module
registered as vendor ``cuda``; TE keeps working for every op.

Device seam: ``load_plugins(device=...)`` / ``install(device=...)``, else ``TE_FL_ATTN_DEVICE``
(a profile spec such as ``h100`` or ``h100:cudnn=9.10.2``, read at load time), else the local GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from ..device import DeviceProfile
from ..selector import Selector
from ..switches import switch
from .ops import OpManager, OpRegistry, SelectionPolicy, discover_plugins
from .router import FlashAttentionRouter
from .te_backend import (
    DPA_UTILS,
    TEBackend,
    current,
    env_defaults,
    get_attention_backend,
    make_backend,
    set_current,
    te_version,
)

logger = logging.getLogger("te_fl_attention.plugin")

MODULE_NAME = "transformer_engine_torch"
NATIVE_NAME = "transformer_engine_torch_nv"
DPA_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
DPA_BACKENDS = "transformer_engine.pytorch.attention.dot_product_attention.backends"


class TexProxy(types.ModuleType):
    """``transformer_engine_torch`` as TE sees it: ``get_attention_backend`` and
    ``flash_attention`` are ours; any other attribute comes from the op manager (dispatchers for
    functions, the native object for classes, enums and constants) and is cached here."""

    def __init__(self, native: types.ModuleType, manager: OpManager) -> None:
        super().__init__(MODULE_NAME, "transformer_engine_torch with te-fl-attention's attention "
                         "backend selection; everything else is TE's native extension.")
        self.__dict__["_native"] = native
        self.__dict__["_manager"] = manager
        self.get_attention_backend = get_attention_backend
        self.flash_attention = FlashAttentionRouter

    def __getattr__(self, name: str) -> Any:
        if name == "__all__":  # `from transformer_engine_torch import *` sees the native names
            native = self.__dict__["_native"]
            names = getattr(native, "__all__", None)
            return list(names) if names is not None else \
                [n for n in dir(native) if not n.startswith("_")]  # fmt: skip
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = self.__dict__["_manager"].resolve(name)
        self.__dict__[name] = value
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(self.__dict__) | set(dir(self.__dict__["_native"])))

    def __repr__(self) -> str:
        return f"<te-fl-attention proxy for {self.__dict__['_native']!r}>"


@dataclass
class _State:
    backend: TEBackend
    proxy: TexProxy | None = None
    saved_modules: dict[str, types.ModuleType | None] = field(default_factory=dict)
    patches: list[tuple[Any, str, bool, Any]] = field(default_factory=list)
    seeded: dict[str, str] = field(default_factory=dict)


_LOCK = threading.RLock()
_STATE: _State | None = None
_LOGGED = False


def load_plugins(device: DeviceProfile | str | None = None, selector: Selector | None = None
                 ) -> TexProxy:  # fmt: skip
    """TE's plugin entry point: install the proxy as ``sys.modules["transformer_engine_torch"]``.

    Idempotent (a second call returns the installed proxy; ``device``/``selector`` given then
    reconfigure it). On any failure ``sys.modules`` and the environment are left as found and the
    exception propagates (TE then rolls back and warns ``NVTE_PLUGIN=... but plugin loading
    failed``)."""
    global _STATE
    with _LOCK:
        found = sys.modules.get(MODULE_NAME)
        if _STATE is not None and _STATE.proxy is not None and found is _STATE.proxy:
            if device is not None or selector is not None:
                configure(device=device, selector=selector)
            return _STATE.proxy
        saved = {name: sys.modules.get(name) for name in (MODULE_NAME, NATIVE_NAME)}
        seeded: dict[str, str] = {}
        try:
            native = _native_module(found)
            backend = make_backend(device, selector)
            proxy = TexProxy(native, _make_manager(native))
            sys.modules[NATIVE_NAME] = native
            sys.modules[MODULE_NAME] = proxy
            seeded = _seed_environment()
        except BaseException:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
            _unseed(seeded)
            raise
        _STATE = _State(backend, proxy, saved, seeded=seeded)
        set_current(backend)
        _log_installed("NVTE_PLUGIN hook (load_plugins)", backend, seeded)
        return proxy


def install(device: DeviceProfile | str | None = None, selector: Selector | None = None) -> None:
    """For a TE without the ``NVTE_PLUGIN`` hook: bind ``dpa_utils.get_attention_backend`` to ours
    (keeping TE's as ``_original_get_attention_backend``) and ``dot_product_attention``'s
    ``FlashAttention`` name to our router, then force TE to re-select. DotProductAttention
    modules built before keep their FlashAttention instance. Idempotent; raises (changing
    nothing) when TE's PyTorch attention cannot be imported."""
    global _STATE
    with _LOCK:
        utils = importlib.import_module(DPA_UTILS)
        dpa = importlib.import_module(DPA_MODULE)
        backend = make_backend(device, selector) if (
            _STATE is None or device is not None or selector is not None) else _STATE.backend
        state = _STATE if _STATE is not None else _State(backend)
        state.backend = backend
        changes: list[tuple[Any, str, bool, Any]] = []
        if utils.get_attention_backend is not get_attention_backend:
            if not hasattr(utils, "_original_get_attention_backend"):
                changes.append((utils, "_original_get_attention_backend", False, None))
                utils._original_get_attention_backend = utils.get_attention_backend
            changes.append((utils, "get_attention_backend", True, utils.get_attention_backend))
            utils.get_attention_backend = get_attention_backend
        if dpa.FlashAttention is not FlashAttentionRouter:
            if not hasattr(dpa, "_FlashAttentionNative"):
                changes.append((dpa, "_FlashAttentionNative", False, None))
                dpa._FlashAttentionNative = dpa.FlashAttention
            changes.append((dpa, "FlashAttention", True, dpa.FlashAttention))
            dpa.FlashAttention = FlashAttentionRouter
        state.patches.extend(changes)
        if not state.seeded:
            state.seeded = _seed_environment()
        _STATE = state
        set_current(backend)
        _reselect()
        _log_installed("install() (TE without the NVTE_PLUGIN hook)", backend, state.seeded)


def uninstall() -> None:
    """Undo :func:`load_plugins` / :func:`install`: TE's selector and FlashAttention come back,
    ``sys.modules["transformer_engine_torch"]`` is the native module again, seeded environment
    variables are removed. TE modules that bound the proxy at import keep it (it forwards)."""
    global _STATE
    with _LOCK:
        state, _STATE = _STATE, None
        set_current(None)
        if state is None:
            return
        for obj, name, existed, old in reversed(state.patches):
            if existed:
                setattr(obj, name, old)
            elif hasattr(obj, name):
                delattr(obj, name)
        utils, dpa = sys.modules.get(DPA_UTILS), sys.modules.get(DPA_MODULE)
        if getattr(utils, "get_attention_backend", None) is get_attention_backend:
            original = getattr(utils, "_original_get_attention_backend", None)
            if original is not None:
                utils.get_attention_backend = original
        if dpa is not None and getattr(dpa, "FlashAttention", None) is FlashAttentionRouter:
            dpa.FlashAttention = getattr(dpa, "_FlashAttentionNative", None) or _native_flash()
        if state.proxy is not None and sys.modules.get(MODULE_NAME) is state.proxy:
            native = state.proxy.__dict__["_native"]
            before = state.saved_modules.get(MODULE_NAME)
            sys.modules[MODULE_NAME] = before if before is not None else native
        _unseed(state.seeded)
        _reselect()


def configure(device: DeviceProfile | str | None = None, selector: Selector | None = None
              ) -> TEBackend:  # fmt: skip
    """Change the device or selector of the installed plugin (a fresh memo; TE re-selects)."""
    with _LOCK:
        old = current()
        backend = make_backend(device if device is not None else
                                (old.device if old is not None else None),
                                selector if selector is not None else
                                (old.selector if old is not None else None))  # fmt: skip
        if _STATE is not None:
            _STATE.backend = backend
        set_current(backend)
        _reselect()
        return backend


def installed() -> bool:
    """Whether :func:`load_plugins` or :func:`install` is in effect."""
    return _STATE is not None


# ---------------------------------------------------------------------------------- helpers
def _native_module(found: types.ModuleType | None) -> types.ModuleType:
    native = sys.modules.get(NATIVE_NAME)
    if native is not None and not isinstance(native, TexProxy):
        return native
    if found is not None and not isinstance(found, TexProxy):
        return found
    raise RuntimeError(
        "TransformerEngine's compiled extension (transformer_engine_torch) is not loaded: set "
        "NVTE_PLUGIN=te_fl_attention before importing transformer_engine.pytorch, or call "
        "te_fl_attention.install() after importing it"
    )


def _make_manager(native: types.ModuleType) -> OpManager:
    registry = OpRegistry()
    discover_plugins(registry)
    return OpManager(registry, SelectionPolicy.from_env(), native=native)


def _seed_environment() -> dict[str, str]:
    """Write each unset policy variable's default (``TE_FL_ATTN_SEED_ENV=0`` opts out)."""
    if not switch("TE_FL_ATTN_SEED_ENV", os.environ):
        return {}
    seeded = {}
    for name, value in env_defaults().items():
        if name not in os.environ:
            os.environ[name] = value
            seeded[name] = value
    return seeded


def _unseed(seeded: dict[str, str]) -> None:
    for name, value in seeded.items():
        if os.environ.get(name) == value:
            del os.environ[name]


def _reselect() -> None:
    """Make TE's DotProductAttention re-run backend selection on its next forward."""
    dpa = sys.modules.get(DPA_MODULE)
    cache = getattr(dpa, "_attention_backends", None)
    if isinstance(cache, dict):
        cache["backend_selection_requires_update"] = True


def _native_flash() -> type:
    return importlib.import_module(DPA_BACKENDS).FlashAttention


def candidates_here(device: DeviceProfile) -> list[str]:
    """What this device could run for a plain config (bf16, bshd, no mask), from each registered
    candidate's rule stage (no graph build, no import, no run): one phrase per candidate or
    flavour, with the library version that runs it."""
    from .. import backends
    from ..config import FusedAttnConfig

    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    sample, out = FusedAttnConfig(), []
    from ..kernels.run import can_run_here

    cpu_only = device.sm is None and device.source == "local"
    for b in backends.all_backends():
        if b.make_probe(graph=False, interpret=interpret).rules(sample, device):
            continue
        if cpu_only and not can_run_here(b.name, sample, device, interpret=interpret)[0]:
            continue  # no GPU here: only what runs on this CPU
        label = b.library[0] if b.library else None
        if b.flavours:
            for f in reversed(b.flavours):  # as users name them: 2, 3, 4
                version = getattr(device, f.version_field or "", None)
                if version:
                    out.append(f"{f.display} ({label} {version})")
            continue
        version = getattr(device, b.library[1], None) if b.library else None
        where = ", interpreter on CPU" if cpu_only and b.library else ""
        out.append(f"{b.display} ({label} {version}{where})" if version else b.display)
    return out


def _log_installed(how: str, backend: TEBackend, seeded: dict[str, str]) -> None:
    global _LOGGED
    if _LOGGED:
        return
    _LOGGED = True
    d = backend.device
    sm = f"sm{d.sm}" if d.sm is not None else "no GPU"
    logger.info("te-fl-attention installed via %s for TransformerEngine %s; device %s (%s, %s); "
                "candidates here: %s%s", how, te_version() or "unknown", d.name, sm, d.source,
                ", ".join(candidates_here(d)),
                f"; seeded for torch.compile guards: {', '.join(sorted(seeded))}" if seeded
                else "")  # fmt: skip


__all__ = ["load_plugins", "install", "uninstall", "configure", "installed",
           "get_attention_backend", "TexProxy", "candidates_here", "MODULE_NAME",
           "NATIVE_NAME"]  # fmt: skip
