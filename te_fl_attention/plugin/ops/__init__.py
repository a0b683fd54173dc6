"""Op registry and dispatch for the TransformerEngine plugin, API-compatible with TE-FL.

Every ``transformer_engine_torch`` attribute that te-fl-attention does not define itself is an
*op*: a name with one or more implementations (``OpImpl``) of three kinds, ``flagos``,
``vendor`` and ``reference``. ``OpRegistry`` holds them, ``SelectionPolicy`` says which to try
first, ``OpManager`` orders the eligible ones, calls them and falls back on failure. TE's compiled
extension (``transformer_engine_torch_nv``) is registered with ``register_native`` as a lazy
source of ``vendor.cuda`` implementations: any public function of it is an op, looked up by name
on first use, never enumerated.

Plugins add implementations with a ``register(registry)`` function, found through the
``te_fl.plugin`` entry-point group and the modules listed in ``TE_FL_PLUGIN_MODULES``
(``discover_plugins``). This package imports only the standard library.

Rooms: :mod:`.env` (``TE_FL_*`` value parsing), :mod:`.log` (the logger, ``TEFL_LOG_LEVEL``),
:mod:`.impl` (``OpImpl``, kinds, errors), :mod:`.policy` (tokens, ``SelectionPolicy``),
:mod:`.registry` (``OpRegistry``, native sources), :mod:`.manager` (``OpManager``: order,
call, fallback), :mod:`.discovery` (plugins).

Environment
-----------
Read by ``SelectionPolicy.from_env`` (once per policy, not per call):

- ``TE_FL_PREFER``: ``flagos`` (default), ``vendor`` or ``reference``, the kind tried first.
- ``TE_FL_PREFER_VENDOR``: comma list of vendor names tried first among vendor implementations.
- ``TE_FL_STRICT``: ``1``/``true``/``yes``/``on`` = no fallback; ``0``/``false``/``no``/``off``/
  unset = fall back to the next candidate when an implementation raises.
- ``TE_FL_ALLOW_VENDORS`` / ``TE_FL_DENY_VENDORS``: comma lists; a non-empty allow list admits
  only the named vendors; deny wins over allow. Only ``vendor`` implementations are filtered.
- ``TE_FL_PER_OP``: ``op=tok|tok;op2=tok`` with tokens ``flagos``, ``vendor``, ``reference``,
  ``vendor:NAME``, ``impl:ID``. The list replaces the default order for that op: implementations
  no token matches are not candidates, not even for fallback (as in TE-FL).
- ``TE_FL_PLUGIN_MODULES``: comma list of modules to import (read by ``discover_plugins``).
- ``TEFL_LOG_LEVEL``: level name for the ``te_fl_attention`` loggers (registry, plugin, and
  each new attention decision at INFO).

Ordering
--------
Per-op tokens if the op has any, else the preferred kind then the others (``flagos``: flagos,
vendor, reference; ``vendor``: vendor, flagos, reference; ``reference``: reference, flagos,
vendor). Implementations that are unavailable, or vendor implementations that the allow/deny lists
exclude, are dropped first. Within one token: vendors named in ``TE_FL_PREFER_VENDOR`` (in that
order) first, then higher ``priority``, then ``impl_id`` ascending. Priority never beats the token
order. An implementation appears once however many tokens match it.

Differences from TE-FL
----------------------
1. ``TE_FL_STRICT=1`` means strict, no fallback, as TE-FL documents: the first eligible
   implementation runs and its exception propagates unchanged. (TE-FL's code falls back unless
   the value is exactly ``0``.) Unset or ``0`` falls back, TE-FL's effective default.
2. Vendor names match case-insensitively everywhere: ``TE_FL_ALLOW_VENDORS``,
   ``TE_FL_DENY_VENDORS``, ``TE_FL_PREFER_VENDOR``, ``vendor:NAME`` tokens and ``OpImpl.vendor``.
   (TE-FL compares exactly, so its documented ``vendor:cuda`` never matched its ``"CUDA"``
   backend.)
3. ``TE_FL_PER_OP`` is validated. An unknown token (e.g. ``default``, ``cuda``, ``vendor:``), an
   entry without ``=``, an empty op name, an op without tokens or an op listed twice raises
   ``ValueError`` naming it (and listing the allowed tokens) when the policy is built. An op
   name that neither the registry nor the native module knows raises ``ValueError`` at the
   manager's first resolve/call/chosen or at an explicit ``OpManager.validate()``, that is after
   plugins have registered their ops, so plugin-defined ops can be configured too. TE-FL ignores
   all of these silently.
4. Fallback is per call: when an implementation fails, the next candidate serves that call only,
   and the next call starts again from the preferred implementation. (TE-FL caches the fallback
   for the rest of the process, so one unsupported input demoted the op for good.)
5. A failing implementation runs once per call. (TE-FL ran a cached implementation that had just
   failed a second time, as the first fallback candidate.)
6. Other invalid values raise ``ValueError`` naming the variable, the value and what is allowed
   (``TE_FL_PREFER=gpu``, ``TE_FL_STRICT=maybe``, ``TEFL_LOG_LEVEL=loud``). TE-FL printed a
   warning and used a default.
7. ``TE_FL_PREFER_VENDOR`` is a comma list of vendor names tried first among vendors. TE-FL's
   legacy values ``1`` (prefer the vendor kind) and ``0`` (no effect) are still understood when
   ``TE_FL_PREFER`` is unset.
8. The native extension is a lazy ``vendor.cuda`` source: functions TE adds in new versions
   resolve without being registered, and non-op attributes (classes, enums, constants) pass
   through unchanged. (TE-FL's stub exposes only the ops its backends registered at load time.)
9. Registrations made after the first call are seen on the next call (no epoch bump), and the
   environment is read once, when the policy is built (TE-FL re-reads ``TE_FL_STRICT`` on every
   call but caches the rest).
10. When every candidate fails, an op with one candidate re-raises the original exception; an op
    with several raises ``AllImplsFailedError`` (a ``RuntimeError``) listing each failure, chained
    to the last one. No eligible candidate raises ``NoImplementationError`` (a
    ``RuntimeError``) saying why each implementation was excluded; an unknown op raises
    ``UnknownOpError`` (an ``AttributeError``).
11. Equal priorities within a token are ordered by ``impl_id`` ascending (TE-FL: descending).
"""

from __future__ import annotations

from .discovery import ENTRY_POINT_GROUP, PluginRecord, discover_plugins
from .impl import (
    KINDS,
    AllImplsFailedError,
    BackendImplKind,
    NoImplementationError,
    OpImpl,
    UnknownOpError,
)
from .log import LOG_LEVELS, LOGGER_NAME, configure_logging
from .manager import OpManager
from .policy import TOKEN_FORMS, SelectionPolicy, match_token
from .registry import OpRegistry, register_native

__all__ = [
    "AllImplsFailedError", "BackendImplKind", "NoImplementationError", "OpImpl", "OpManager",
    "OpRegistry", "PluginRecord", "SelectionPolicy", "UnknownOpError", "configure_logging",
    "discover_plugins", "match_token", "register_native",
    "ENTRY_POINT_GROUP", "KINDS", "LOGGER_NAME", "LOG_LEVELS", "TOKEN_FORMS",
]  # fmt: skip
