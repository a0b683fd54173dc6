"""Tile choice for our Triton kernels: size buckets, a persistent store, our own timing loop.

A :class:`TuneKey` names everything the best tile depends on: the device (name, sm, SM count,
memory), the kernel (``fwd``, ``dq``, ``dkdv``), the kernel code (a digest of its source and the
Triton version), dtype and head dims, the feature flags (causal, window left/right and its span,
bottom-right alignment, actual lengths, varlen, the GQA group and whether dK/dV are split) and
buckets of the problem size (next power of two of the query rows, key rows and batch x heads,
clipped). A tiny 16-token run and a 4,096-token one therefore never share a choice.

The first launch for a key times every candidate (:func:`time_ms`: CUDA events, warm-up, median)
and keeps the fastest. The choice is remembered in memory and in the :class:`TuningStore` (an
in-memory one by default; :func:`te_fl_attention.cache.tuning.install` keeps choices in the
SQLite probe cache, so a warm job never tunes). A stored choice is used only if it is one of the
candidates offered now; anything else (a config we no longer keep, a damaged row) is ignored and
re-tuned.

Importing this module is cheap (no torch, no triton): the probe cache adapter imports it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("te_fl_attention.tuning")

__all__ = [
    "Config",
    "MemoryTuningStore",
    "TuneKey",
    "Tuner",
    "TuningStore",
    "bucket",
    "get_store",
    "set_store",
    "time_ms",
    "tuner",
]

#: Size buckets: next power of two, clipped to these bounds (rows; batch x heads).
ROWS_MIN, ROWS_MAX = 64, 16384
PROGRAMS_MIN, PROGRAMS_MAX = 1, 1024
#: Timing loop defaults: warm-up launches (the first one compiles), timed launches (median).
WARMUP, REPS = 3, 10


def bucket(n: int, lo: int = ROWS_MIN, hi: int = ROWS_MAX) -> int:
    """``n``'s size bucket: the next power of two, clipped to ``[lo, hi]``."""
    p = 1 << max(int(n) - 1, 0).bit_length()
    return min(max(p, lo), hi)


@dataclass(frozen=True, order=True)
class Config:
    """One tile: block sizes along queries / keys, warps per program, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Config | None:
        """The config ``d`` describes, or ``None`` when ``d`` is not a well-formed one."""
        if not isinstance(d, Mapping) or set(d) != {f.name for f in dataclasses.fields(cls)}:
            return None
        values = [d[f.name] for f in dataclasses.fields(cls)]
        if not all(type(v) is int and 0 < v <= 1024 for v in values):
            return None
        return cls(*values)

    def launch_meta(self) -> dict[str, int]:
        """Keyword arguments of a Triton launch with this tile."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages}  # fmt: skip


@dataclass(frozen=True)
class TuneKey:
    """What a tile choice is valid for (see the module docstring)."""

    kernel: str
    device: str
    sm: int
    sm_count: int
    memory_gib: float
    code: str
    dtype: str
    d_qk: int
    d_v: int
    causal: bool
    window_left: bool
    window_right: bool
    window_span: int  # bucket of left + right + 1 when both are bounded, else 0
    bottom_right: bool
    lens: bool
    varlen: bool
    group: int  # q heads per kv head, bucketed
    gqa_split: bool
    rows_q: int  # bucket
    rows_kv: int  # bucket
    programs: int  # bucket of batch x heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def canonical(self) -> str:
        """Stable JSON text of the key (sorted fields): what the store is keyed on."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """sha256 hex of :meth:`canonical`."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()


class TuningStore(Protocol):
    """Where tuned choices live between processes. ``get`` returns what ``put`` stored (a JSON
    mapping with at least ``config``) or ``None``; neither may raise for a missing key."""

    def get(self, key: TuneKey) -> Mapping[str, Any] | None: ...

    def put(self, key: TuneKey, choice: Mapping[str, Any]) -> None: ...


class MemoryTuningStore:
    """The default store: this process only."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}

    def get(self, key: TuneKey) -> Mapping[str, Any] | None:
        return self._rows.get(key.canonical())

    def put(self, key: TuneKey, choice: Mapping[str, Any]) -> None:
        self._rows[key.canonical()] = json.loads(json.dumps(dict(choice)))

    def __len__(self) -> int:
        return len(self._rows)


def time_ms(fn: Callable[[], Any], warmup: int = WARMUP, reps: int = REPS) -> float:  # gpu-only
    """Median time of ``fn`` in ms: ``warmup`` untimed calls (the first compiles), then ``reps``
    calls each between two CUDA events on the current stream. Never ran on a GPU."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(reps, 1)):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


class Tuner:
    """Picks a tile per :class:`TuneKey`: memo, then the store (validated), then timing.

    ``benchmarks`` counts candidate timings and ``tunings`` the keys tuned in this process (a
    warm process has both at 0); ``events`` records ``(how, key, config)`` per decision, ``how``
    one of ``tuned``, ``stored``, ``ignored`` (a stored choice that was not a candidate),
    ``untimed`` (no timing allowed: the smallest tile, not remembered).
    """

    def __init__(self, store: TuningStore | None = None, *, warmup: int = WARMUP,
                 reps: int = REPS) -> None:  # fmt: skip
        self.store: TuningStore = store if store is not None else MemoryTuningStore()
        self.warmup = warmup
        self.reps = reps
        self.benchmarks = 0
        self.tunings = 0
        self.events: list[tuple[str, TuneKey, Config | None]] = []
        self._memo: dict[tuple[TuneKey, tuple[Config, ...]], Config] = {}
        self._lock = threading.RLock()

    def clear(self) -> None:
        """Forget the in-process memo and counters (the store keeps its rows)."""
        with self._lock:
            self._memo.clear()
            self.events.clear()
            self.benchmarks = self.tunings = 0

    def stored(self, key: TuneKey, candidates: Sequence[Config]) -> Config | None:
        """The store's choice for ``key`` if it is one of ``candidates``, else ``None``."""
        try:
            row = self.store.get(key)
        except Exception as exc:  # noqa: BLE001 - a broken store is a miss, never a failure
            log.warning("tuning store %r failed to read (%s); tuning instead", self.store, exc)
            return None
        if row is None:
            return None
        cfg = Config.from_dict(row.get("config")) if isinstance(row, Mapping) else None
        if cfg is None or cfg not in candidates:
            log.warning("ignoring stored %s tile %r for %s: not one of the configs kept now",
                        key.kernel, row, key.canonical())  # fmt: skip
            self.events.append(("ignored", key, cfg))
            return None
        self.events.append(("stored", key, cfg))
        return cfg

    def choose(
        self,
        key: TuneKey,
        candidates: Sequence[Config],
        run: Callable[[Config], Any],
        *,
        skip: tuple[type[BaseException], ...] = (),
        can_time: bool = True,
    ) -> Config:
        """The tile for ``key`` among ``candidates``; ``run(config)`` launches the kernel once.
        Candidates whose launch raises one of ``skip`` (does not fit the device) are left out.
        ``can_time=False`` (a CUDA graph is being captured: no timing, no synchronize): the
        stored choice, else the last (smallest) candidate, remembered for nothing."""
        cands = tuple(candidates)
        if not cands:
            raise ValueError(f"no candidate configs for {key.kernel}")
        with self._lock:
            memo = self._memo.get((key, cands))
            if memo is not None:
                return memo
            cfg = cands[0] if len(cands) == 1 else self.stored(key, cands)
            if cfg is None:
                if not can_time:
                    self.events.append(("untimed", key, cands[-1]))
                    return cands[-1]
                cfg = self._tune(key, cands, run, skip)
            self._memo[(key, cands)] = cfg
            return cfg

    def _tune(self, key: TuneKey, cands: tuple[Config, ...], run: Callable[[Config], Any],
              skip: tuple[type[BaseException], ...]) -> Config:  # fmt: skip
        times: dict[Config, float] = {}
        failed: list[str] = []
        last: BaseException | None = None
        for cfg in cands:
            self.benchmarks += 1
            try:
                times[cfg] = time_ms(lambda c=cfg: run(c), self.warmup, self.reps)
            except skip as exc:
                failed.append(f"{cfg.name}: {type(exc).__name__}")
                last = exc
        if not times:
            assert last is not None
            raise last
        best = min(times, key=lambda c: (times[c], cands.index(c)))
        self.tunings += 1
        self.events.append(("tuned", key, best))
        choice = {"config": best.to_dict(), "times_ms": {c.name: t for c, t in times.items()},
                  "failed": failed}  # fmt: skip
        try:
            self.store.put(key, choice)
        except Exception as exc:  # noqa: BLE001 - the choice still holds for this process
            log.warning("tuning store %r failed to write (%s)", self.store, exc)
        return best


_TUNER = Tuner()


def tuner() -> Tuner:
    """The process-wide tuner our kernels launch through."""
    return _TUNER


def set_store(store: TuningStore | None) -> TuningStore:
    """Keep tuned choices in ``store`` from now on (``None``: a fresh in-memory store); the
    in-process memo is cleared so the next launch consults the new store. Returns it."""
    with _TUNER._lock:
        _TUNER.store = store if store is not None else MemoryTuningStore()
        _TUNER._memo.clear()
        return _TUNER.store


def get_store() -> TuningStore:
    return _TUNER.store
