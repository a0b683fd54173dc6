"""The candidate registry: one :class:`Backend` descriptor per attention backend.

Everything that needs to know the candidates reads them here: the policy (switches, aliases,
priority, flavour order), the probes list, reasons and rendering (display names), the matrix,
fleet planning and its report (colours), the plugin (TE's slot, the router) and
:mod:`te_fl_attention.kernels.run` (runners). Adding a backend is one module holding its probe
(and runner) plus one :func:`register` call.

This module imports nothing from the package: a descriptor names its probe and runner as
``"module:attribute"`` strings (or holds the callables themselves), resolved on first use, so the
vocabulary layer can read display names without importing a probe.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: TE's three slots in ``get_attention_backend``'s tuple. A backend of ours rides one of them:
#: Triton runs in TE's ``FlashAttention`` slot, routed by our FlashAttention class.
TE_SLOTS = ("flash", "fused", "unfused")


@dataclass(frozen=True)
class Flavour:
    """One flavour of a multi-flavour candidate (flash-attn 2/3/4 of ``flash``)."""

    name: str
    display: str
    switch: str | None = None  # an env var that turns this flavour off with 0 (after the parent's)
    aliases: tuple[str, ...] = ()
    version_field: str | None = None  # the DeviceProfile field holding its installed version


@dataclass(frozen=True)
class Backend:
    """A candidate: how users name it, how TE sees it, where it ranks, what probes and runs it.

    ``switches``: environment variables that must all be on for the candidate (TE's ``NVTE_*``
    parsed as TE parses them, ours ``0``/``1``); ``rank``: its place in the priority order on
    (sm >= 90, sm < 90) devices, lower first; ``flavours``: in precedence order, most preferred
    first; ``probe``: a factory called with the ``probe_options`` it accepts (``graph``: build
    cuDNN graphs, ``interpret``: the Triton interpreter may run on CPU); ``runner``: the
    :data:`te_fl_attention.kernels.run.Runner` that runs it (``None``: TE's own module runs it);
    ``runs_on_cpu``: its runner runs without a GPU."""

    name: str
    display: str
    te_slot: str
    switches: tuple[str, ...]
    rank: tuple[int, int]
    probe: str | Callable[..., Any]
    aliases: tuple[str, ...] = ()
    flavours: tuple[Flavour, ...] = ()
    probe_options: tuple[str, ...] = ()
    runner: str | Callable[..., Any] | None = None
    runs_on_cpu: bool = False
    colours: tuple[str, str] = ("#4a4a4a", "#ececec")  # (text, background) in the fleet report
    style: str = "white"  # its rich style in terminal tables
    version_label: str | None = None  # the PEP 440 local label TE sees for our own kernels
    library: tuple[str, str] | None = None  # (its name, the DeviceProfile field of its version)

    def __post_init__(self) -> None:
        if self.te_slot not in TE_SLOTS:
            raise ValueError(f"Backend {self.name!r}: te_slot={self.te_slot!r} is not one of "
                             f"{', '.join(TE_SLOTS)}")  # fmt: skip
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"Backend name {self.name!r} must be a lower-case identifier")

    def make_probe(self, **options: Any) -> Any:
        """The probe, given the options it takes (others are left out)."""
        factory = resolve(self.probe)
        return factory(**{k: v for k, v in options.items() if k in self.probe_options})

    def flavour_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.flavours)


def resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """A ``"module:attribute"`` reference (or a callable, returned as is) as the object."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


_FLASH_FLAVOURS = (
    Flavour("fa4", "FlashAttention 4", "NVTE_FLASH_ATTN_V4", ("flash_attn_4",), "flash_attn_4"),
    Flavour("fa3", "FlashAttention 3", "NVTE_FLASH_ATTN_V3", ("flash_attn_3",), "flash_attn_3"),
    Flavour("fa2", "FlashAttention 2", "NVTE_FLASH_ATTN_V2", ("flash_attn_2",), "flash_attn"),
)

_BUILTIN = (
    Backend("fused", "FusedAttention", "fused", ("NVTE_FUSED_ATTN",), (0, 20),
            "te_fl_attention.probes.fused.probe:CudnnProbe", ("cudnn", "fusedattention"),
            probe_options=("graph",), runner="te_fl_attention.kernels.run:run_fused",
            colours=("#1b7f3b", "#e2f3e7"), style="green", library=("cuDNN", "cudnn")),
    Backend("flash", "FlashAttention", "flash", ("NVTE_FLASH_ATTN",), (10, 0),
            "te_fl_attention.probes.flash.probe:FlashAttnProbe", ("flashattention", "flash_attn"),
            flavours=_FLASH_FLAVOURS, runner="te_fl_attention.kernels.run:run_first_flash",
            colours=("#1f5fbf", "#e2ecfb"), style="blue", library=("flash-attn", "flash_attn")),
    Backend("triton", "TritonFlashAttention", "flash", ("NVTE_FLASH_ATTN", "TE_FL_ATTN_TRITON"),
            (20, 10), "te_fl_attention.probes.triton:TritonFlashProbe",
            ("tritonflash", "tritonflashattention"), probe_options=("interpret",),
            runner="te_fl_attention.kernels.run:run_triton", runs_on_cpu=True,
            colours=("#7b3fa0", "#f1e6f8"), style="magenta", version_label="tefl.triton",
            library=("triton", "triton")),
    Backend("unfused", "UnfusedDotProductAttention", "unfused", ("NVTE_UNFUSED_ATTN",), (90, 90),
            "te_fl_attention.probes.unfused:UnfusedProbe",
            ("unfuseddotproductattention", "reference"),
            runner="te_fl_attention.kernels.run:run_unfused", runs_on_cpu=True,
            colours=("#c2600a", "#fdeedd"), style="yellow"),
)  # fmt: skip

_REGISTRY: dict[str, Backend] = {b.name: b for b in _BUILTIN}
_LOCK = threading.Lock()
_VERSION = [0]  # bumped on every change: readers that precompute from the registry recheck it
_VIEWS: dict[str, Any] = {}


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the candidates (after the others in display order). A name or alias
    already taken is an error unless ``replace`` (same name only)."""
    with _LOCK:
        taken = {n: b.name for b in _REGISTRY.values() if b.name != backend.name
                 for n in _names_of(b)}  # fmt: skip
        clash = sorted(n for n in _names_of(backend) if n in taken)
        if clash:
            raise ValueError(f"Backend {backend.name!r}: name(s) {', '.join(clash)} already "
                             f"belong to {', '.join(sorted({taken[n] for n in clash}))}")
        if backend.name in _REGISTRY and not replace:
            raise ValueError(f"Backend {backend.name!r} is already registered "
                             "(register(..., replace=True) to replace it)")
        _REGISTRY[backend.name] = backend
        _changed()
    return backend


def unregister(name: str) -> None:
    """Remove a registered backend (built-in ones included: a test may need that)."""
    with _LOCK:
        if _REGISTRY.pop(name, None) is not None:
            _changed()


def _changed() -> None:
    _VERSION[0] += 1
    _VIEWS.clear()


def version() -> int:
    """A number that changes whenever the registry does (for callers that precompute)."""
    return _VERSION[0]


def _names_of(b: Backend) -> tuple[str, ...]:
    return (b.name, *b.aliases, *(n for f in b.flavours for n in (f.name, *f.aliases)))


def all_backends() -> tuple[Backend, ...]:
    """Every candidate, in display order."""
    return tuple(_REGISTRY.values())


def get(name: str) -> Backend:
    """The candidate named ``name`` (canonical name); ``KeyError`` with the allowed ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"backend {name!r} is not registered; registered: "
                       f"{', '.join(_REGISTRY)}") from None  # fmt: skip


def find(name: str) -> Backend | None:
    return _REGISTRY.get(name)


def _view(key: str, build: Callable[[], Any]) -> Any:
    hit = _VIEWS.get(key)
    if hit is None:
        hit = _VIEWS[key] = build()
    return hit


def names() -> tuple[str, ...]:
    """Candidate names, in display order."""
    return _view("names", lambda: tuple(_REGISTRY))


def flavours() -> dict[str, Flavour]:
    """Flavour name -> flavour, over every multi-flavour candidate."""
    return _view("flavours", lambda: {f.name: f for b in _REGISTRY.values() for f in b.flavours})


def parent() -> dict[str, str]:
    """Flavour name -> its candidate's name."""
    return _view("parent", lambda: {f.name: b.name for b in _REGISTRY.values()
                                    for f in b.flavours})  # fmt: skip


def units() -> tuple[str, ...]:
    """Everything a policy can switch on or off: candidates and flavours, in display order."""
    return _view("units", lambda: tuple(n for b in _REGISTRY.values()
                                        for n in (b.name, *b.flavour_names())))  # fmt: skip


def display_names() -> dict[str, str]:
    """Candidate or flavour name -> its display name."""
    return _view("display", lambda: {**{b.name: b.display for b in _REGISTRY.values()},
                                     **{f.name: f.display for f in flavours().values()}})


def display(name: str | None, default: str | None = None) -> str:
    """The display name of a candidate or flavour (``default``, else the name, if unknown)."""
    if name is None:
        return default or "no backend"
    return display_names().get(name, default if default is not None else name)


def aliases() -> dict[str, str]:
    """Every accepted spelling (lower case) -> canonical candidate or flavour name."""

    def build() -> dict[str, str]:
        out: dict[str, str] = {}
        for b in _REGISTRY.values():
            out.update({n: b.name for n in (b.name, *b.aliases)})
            for f in b.flavours:
                out.update({n: f.name for n in (f.name, *f.aliases)})
        return out

    return _view("aliases", build)


def switches(unit: str) -> tuple[str, ...]:
    """The environment variables that must all be on for a candidate or flavour, in the order
    they are read (a flavour's after its candidate's: TE reads NVTE_FLASH_ATTN_V2 only when
    NVTE_FLASH_ATTN is on)."""

    def build() -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for b in _REGISTRY.values():
            out[b.name] = b.switches
            for f in b.flavours:
                out[f.name] = b.switches + ((f.switch,) if f.switch else ())
        return out

    return _view("switches", build)[unit]


def switch_vars() -> tuple[str, ...]:
    """Every backend switch, each once, in registry order."""
    return _view("switch_vars", lambda: tuple(dict.fromkeys(
        v for u in units() for v in switches(u))))


def priority(sm: int | None) -> tuple[str, ...]:
    """The candidates in priority order on a device of compute capability ``sm`` (TE's: sm >= 90
    fused > flash > unfused, else flash > fused > unfused; Triton after flash-attn)."""
    col = 0 if (sm or 0) >= 90 else 1
    return _view(f"priority{col}", lambda: tuple(
        b.name for b in sorted(_REGISTRY.values(), key=lambda b: b.rank[col])))


def precedence(name: str) -> tuple[str, ...]:
    """A candidate's flavours, most preferred first (``()`` for a single-flavour one)."""
    b = _REGISTRY.get(name)
    return b.flavour_names() if b is not None else ()


def in_slot(slot: str) -> tuple[str, ...]:
    """The candidates that ride TE's ``slot``, in priority order as on sm < 90."""
    return tuple(n for n in priority(None) if _REGISTRY[n].te_slot == slot)


__all__ = ["Backend", "Flavour", "TE_SLOTS", "register", "unregister", "all_backends", "get",
           "find", "names", "flavours", "parent", "units", "display_names", "display", "aliases",
           "switches", "switch_vars", "priority", "precedence", "in_slot", "resolve", "version"]
