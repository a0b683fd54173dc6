"""`Selector`: memo -> probe cache -> probes -> (verification, measurement) -> policy ->
`Decision`.

The hot path is a dict lookup keyed on the frozen (config, device, policy) triple: no I/O, no
hashing beyond the dataclasses' own ``__hash__``. With ``Policy(verify=True)`` /
``Policy(measure=True)`` two more stages run on the candidates that can run here; their results
are stored as rows of their own (same config key, backend and device fingerprint, a versions key
that adds the stage, see :meth:`Selector.stage_env`), so probe rows are shared by every policy.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import backends
from .config import FusedAttnConfig
from .decide import decide, units
from .device import DeviceProfile, profile
from .policy import Policy
from .probes import Probe, default_probes
from .reasons import Decision, NoBackendError, ProbeResult, combine_variants

if TYPE_CHECKING:
    from .cache.interface import Store


class Selector:
    """Chooses a backend for a config on a device under a policy, and remembers the answer."""

    def __init__(self, probes: Iterable[Probe] | None = None, cache: Store | None = None,
                 memo_size: int = 65536):  # fmt: skip
        self.probes: tuple[Probe, ...] = tuple(probes) if probes is not None else _default_probes()
        self.cache = cache
        self._memo: dict[tuple, Decision] = {}
        self._results: dict[tuple, tuple[ProbeResult, ...]] = {}
        self._memo_size = memo_size
        self._lock = threading.Lock()
        self.stats = {"memo_hits": 0, "cache_hits": 0, "probes": 0}
        self._keys: Any = None
        #: (device fingerprint, versions key) -> the store's rows of that slice, undecoded
        #: (``load_slice``), or None when the store answers per config only.
        self._slices: dict[tuple[str, str], dict | None] = {}
        self._staged: dict[tuple, ProbeResult] = {}

    @property
    def keys(self) -> Any:
        """The :class:`~.cache.keys.KeySpace` of this selector's probes (every key it reads
        and writes rows under)."""
        if self._keys is None:
            from .cache.keys import KeySpace

            self._keys = KeySpace(self.probes)
        return self._keys

    @property
    def interpret(self) -> bool:
        """Whether this selector's Triton probe may use the Triton interpreter on CPU (and so
        whether verification and measurement may run the Triton kernel there)."""
        return any(getattr(p, "interpret", False) for p in self.probes)

    # ------------------------------------------------------------------ results
    def probe_env(self) -> dict[str, Any]:
        """What this process's probes can run, folded into every cache key
        (:meth:`.cache.keys.KeySpace.env`)."""
        return self.keys.env()

    def prepare(self, device: DeviceProfile | str | None = None) -> None:
        """Start-up work, done once so the first selection is a lookup: resolve the device,
        digest the probes, compute the device's cache-key parts, open the store and ready its
        lookups (``warm_up``: compiled statements, the top of the table, the decoder), read the
        device's slice of the store in one query (``load_slice``), parse the environment's
        policy (what :meth:`decide` uses by default), and run the per-selection steps a few
        times on a made-up config and made-up results (reading the policy, the rule stage every
        hit is held to, the decision, the key), so the interpreter has specialised them before
        the first real selection. Probes nothing and reads no real row twice."""
        dev = profile(device)
        rows = None
        if self.cache is not None:
            warm_up = getattr(self.cache, "warm_up", None)
            if warm_up is not None:
                warm_up()
            else:  # a store of the user's without it: at least open it
                len(self.cache)
            rows = self._slice(dev)
        stored: dict[str, list[ProbeResult]] = {}  # a few real rows per candidate, left in place
        for (_, name), row in (rows or {}).items():
            if isinstance(row, ProbeResult) and len(stored.setdefault(name, [])) < 4:
                stored[name].append(row)
        for i in range(8):  # a few runs: the interpreter specialises code that ran a few times
            sample = FusedAttnConfig(**_SAMPLES[i % len(_SAMPLES)])
            pol = Policy.from_env()  # each run, as decide() reads it (the dry run is given it)
            self._cache_keys(sample, dev)
            held = []
            for p in self.probes:
                try:
                    reasons = p.rules(sample, dev)
                    some = stored.get(p.name)
                    row = some[i % len(some)] if some else _made_up(p.name, not reasons)
                    held.append(narrow(p, row, sample, dev) or row)
                except Exception:  # noqa: BLE001, S112 - a broken probe is reported when it decides
                    continue
            if rows is not None and len(held) == len(self.probes) and not (
                    pol.verify or pol.measure):  # fmt: skip
                self._dry_select(sample, dev, pol, rows, held)  # decide() runs within
            else:
                decide(sample, dev, held, pol, source="cache")

    def _dry_select(self, sample: FusedAttnConfig, device: DeviceProfile, pol: Policy,
                    rows: dict, held: list[ProbeResult]) -> None:  # fmt: skip
        """One whole :meth:`decide` of ``sample`` answered from ``held``, placed in the slice
        for it (so the path a warm selection takes, from the policy to the memo, has run before
        the first real one); the slice, the memos and the counters are left as they were."""
        ck = sample.key()
        saved = {p.name: rows.get((ck, p.name)) for p in self.probes}
        stats = dict(self.stats)
        rows.update({(ck, p.name): r for p, r in zip(self.probes, held, strict=True)})
        try:
            self.decide(sample, device, pol)
        finally:
            for name, row in saved.items():
                if row is None:
                    rows.pop((ck, name), None)
                else:
                    rows[(ck, name)] = row
            with self._lock:
                self._memo.pop((sample, device, pol), None)
                self._results.pop((sample, device), None)
            self.stats.clear()
            self.stats.update(stats)

    def _cache_keys(self, config: FusedAttnConfig, device: DeviceProfile) -> dict[str, Any]:
        return self.keys.keys(config, device, [p.name for p in self.probes])

    def _slice(self, device: DeviceProfile) -> dict | None:
        """The store's rows for ``device`` and this process's software stack, read in one query
        the first time (``load_slice``; ``None``: the store answers per config)."""
        key = (device.fingerprint(), self.keys.versions(device))
        try:
            return self._slices[key]
        except KeyError:
            pass
        load = getattr(self.cache, "load_slice", None)
        rows = load(*key) if load is not None and hasattr(self.cache, "decode_row") else None
        with self._lock:
            self._slices[key] = rows
        return rows

    def _lookup(self, config: FusedAttnConfig, device: DeviceProfile) -> dict[str, ProbeResult]:
        """The stored results for ``config`` on ``device``, by candidate name: from the device's
        slice (a row already decoded is taken as it is; a large slice's rows are decoded now,
        on first use), then one store query for what the slice lacks (rows written since it
        was read, rows that did not decode). Cache keys are built only for those reads."""
        rows = self._slice(device)
        if rows is None:
            keys = self._cache_keys(config, device)
            got = self.cache.get_many(list(keys.values()))  # type: ignore[union-attr]
            return {n: got[k] for n, k in keys.items() if k in got}
        found, missing = {}, []
        ck = config.key()
        for p in self.probes:
            row = rows.pop((ck, p.name), None)  # used once: the result memo keeps it
            if row is not None and type(row) is not ProbeResult:  # stored bytes: decode now
                key = self.keys.key(config, p.name, device)
                row = self.cache.decode_row(key, row)  # type: ignore[union-attr]
            if row is None:
                missing.append(p.name)
            else:
                found[p.name] = row
        if missing:
            keys = self.keys.keys(config, device, missing)
            got = self.cache.get_many(list(keys.values()))  # type: ignore[union-attr]
            found.update({n: got[k] for n, k in keys.items() if k in got})
        return found

    def probe_all(self, config: FusedAttnConfig, device: DeviceProfile
                  ) -> tuple[tuple[ProbeResult, ...], str]:  # fmt: skip
        """Every candidate's raw result (before policy) and where they came from: the memo,
        the persistent cache (one query for all candidates), or the probes (then written back
        in one transaction)."""
        rkey = (config, device)
        hit = self._results.get(rkey)
        if hit is not None:
            return hit, "memo"
        found = self._lookup(config, device) if self.cache is not None else {}
        results, fresh = [], []
        for p in self.probes:
            result = found.get(p.name)
            if result is not None:  # evidence from elsewhere: our own rules still bind
                result = narrow(p, result, config, device)
            if result is None:
                self.stats["probes"] += 1
                try:
                    result = p.probe(config, device)
                except Exception as exc:  # noqa: BLE001 - one probe's bug is its own refusal
                    result = probe_error(p.name, exc)  # not stored: the next job probes again
                else:
                    fresh.append((p.name, result))
            else:
                self.stats["cache_hits"] += 1
            results.append(result)
        if self.cache is not None and fresh:
            keys = self._cache_keys(config, device)
            self.cache.put_many(
                [(keys[n], r, config.to_dict(), device.to_dict()) for n, r in fresh]
            )
        out = tuple(results)
        with self._lock:
            if len(self._results) >= self._memo_size:
                self._results.clear()
            self._results[rkey] = out
        return out, ("probe" if fresh else "cache")

    # ------------------------------------------------------------------ decisions
    def decide(self, config: FusedAttnConfig, device: DeviceProfile | str | None = None,
               policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
        """The full decision (never raises for "no backend": ``chosen`` is then ``None``)."""
        dev = profile(device)
        pol = policy if policy is not None else Policy.from_env()
        if force is not None:
            pol = pol.with_(force=force)
        mkey = (config, dev, pol)
        hit = self._memo.get(mkey)
        if hit is not None:
            self.stats["memo_hits"] += 1
            return hit
        raw, source = self.probe_all(config, dev)
        for stage in ("verify", "measure"):
            if getattr(pol, stage) and dev.source == "local":
                raw, fresh = self._stage(stage, config, dev, raw, pol)
                source = "probe" if fresh else source
        measured = None
        if pol.measure:
            from . import measure

            measured = measure.describe(config, dev)
        decision = decide(config, dev, raw, pol, source=source, measured=measured)
        with self._lock:
            if len(self._memo) >= self._memo_size:
                self._memo.clear()
            self._memo[mkey] = decision
        return decision

    def select(self, config: FusedAttnConfig, device: DeviceProfile | str | None = None,
               policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
        """Like :meth:`decide`, but raises :class:`NoBackendError` when nothing is supported
        (also when a forced backend is unsupported: the error carries its reasons)."""
        decision = self.decide(config, device, policy, force)
        if decision.chosen is None:
            raise NoBackendError(decision)
        return decision

    def graph_spec(self, config: FusedAttnConfig, device: DeviceProfile | str | None = None
                   ) -> dict[str, Any] | None:  # fmt: skip
        """The cuDNN graphs the fused candidate's probe builds for ``config`` on ``device``
        (cudnn-frontend's JSON of the forward and, for training, the backward graph, with
        cuDNN's verdict), or ``None`` when this selector's fused probe builds no graphs. Built
        afresh (a graph is not stored in the probe cache)."""
        dev = profile(device)
        probe = next((p for p in self.probes if p.name == "fused"), None)
        build = getattr(probe, "graph_spec", None) if getattr(probe, "graph", False) else None
        return build(config, dev) if build is not None else None

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._results.clear()
            self._staged.clear()
            self._slices.clear()

    # ------------------------------------------------------------------ verification, measurement
    def _stage(self, stage: str, config: FusedAttnConfig, device: DeviceProfile,
               raw: tuple[ProbeResult, ...], pol: Policy) -> tuple[tuple[ProbeResult, ...], bool]:
        """Run ``stage`` (``verify`` or ``measure``) on every supported unit (candidate, or flash
        flavour) the policy leaves enabled and that can run here; memo, then the store, then the
        stage itself. Returns the updated raw results and whether anything ran."""
        from . import measure, verify
        from .kernels import run as runner

        mod = verify if stage == "verify" else measure
        wanted = set()
        for r in raw:
            wanted |= {u.backend for u in units(pol.filter(r)) if u.supported}
        own: dict[str, ProbeResult] = {}
        todo: list[str] = []
        for r in raw:
            for u in units(r):
                if not u.supported or u.backend not in wanted:
                    continue
                ok, why = runner.can_run_here(u.backend, config, device, interpret=self.interpret)
                hit = self._staged.get((stage, config, device, u.backend)) if ok else None
                if not ok:
                    own[u.backend] = mod.skipped(u.backend, f"not run here: {why}")
                elif hit is not None:
                    own[u.backend] = hit
                else:
                    todo.append(u.backend)
        keys = {}
        if todo and self.cache is not None:
            keys = self.keys.keys(config, device, todo, stage)
            found = self.cache.get_many(list(keys.values()))
            for n in list(todo):
                if keys[n] in found:
                    own[n] = self._staged[(stage, config, device, n)] = found[keys[n]]
                    todo.remove(n)
                    self.stats["cache_hits"] += 1
        fresh = []
        for n in todo:
            result, store = mod.check(n, config, device)
            own[n] = result
            self.stats[f"{stage}_runs"] = self.stats.get(f"{stage}_runs", 0) + 1
            if store:
                self._staged[(stage, config, device, n)] = result
                if n in keys:
                    fresh.append((keys[n], result, config.to_dict(), device.to_dict()))
        if fresh:
            self.cache.put_many(fresh)  # type: ignore[union-attr]
        out = []
        for r in raw:
            if r.variants:
                variants = tuple(verify.merge(v, own[v.backend]) if v.backend in own else v
                                 for v in r.variants)  # fmt: skip
                out.append(combine_variants(r.backend, variants, r.elapsed_ms)
                           if variants != r.variants else r)
            else:
                out.append(verify.merge(r, own[r.backend]) if r.backend in own else r)
        return tuple(out), bool(todo)


def narrow(probe: Probe, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
           ) -> ProbeResult | None:  # fmt: skip
    """``cached`` (a probe-cache row: this machine's earlier run, an import, a merge, the Redis
    tier) under this process's own rule stage. The rules always run here; a cached result may
    only refuse more than they do: where they refuse, their refusal stands whatever the row
    claims. ``None``: the row is not a result of this candidate (probe again).

    Probes say how (``probe.narrow``: FusedAttention binds TE's filters, not the support-table
    predictions cuDNN's verdict replaces; FlashAttention flavour by flavour); any other probe is
    held to everything its ``rules`` refuse."""
    own = getattr(probe, "narrow", None)
    if own is not None:
        return own(cached, config, device)
    if cached.backend != probe.name:
        return None
    reasons = probe.rules(config, device)
    if not reasons:
        return cached
    return ProbeResult(probe.name, False, tuple(reasons), reasons[0].stage, "rules")


#: The configs :meth:`Selector.prepare` dry-runs (common kinds: GQA causal training, MHA
#: without a mask, cross-attention inference, fp16 with a bottom-right mask).
_SAMPLES = (
    dict(num_heads=32, num_gqa_groups=8, max_seqlen_q=4096, max_seqlen_kv=4096,
         attn_mask_type="causal"),
    dict(num_heads=16, max_seqlen_q=128, max_seqlen_kv=128),
    dict(num_heads=16, num_gqa_groups=1, max_seqlen_q=1, max_seqlen_kv=2048, is_training=False),
    dict(num_heads=24, num_gqa_groups=4, head_dim_qk=192, head_dim_v=128, dtype="fp16",
         max_seqlen_q=2048, max_seqlen_kv=4096, attn_mask_type="causal_bottom_right"),
)  # fmt: skip


def _made_up(name: str, supported: bool) -> ProbeResult:
    """A result of candidate ``name`` for :meth:`Selector.prepare`'s dry runs (never stored)."""
    flavours = backends.precedence(name)
    if not flavours:
        return ProbeResult(name, supported, evidence="prepare")
    return combine_variants(name, tuple(ProbeResult(f, supported, evidence="prepare")
                                        for f in flavours))


def probe_error(backend: str, exc: BaseException) -> ProbeResult:
    """The refusal a candidate gets when its probe raises (code ``probe.error``, stage
    ``probe``): the selection goes on with the other candidates."""
    from .reasons import Reason

    name = backends.display(backend)
    text = f"{type(exc).__name__}: {exc}"[:2000]
    why = Reason("probe.error", f"the {name} probe raised {text}", "probe",
                 observed=type(exc).__name__, limit="a probe that returns a verdict",
                 hint="a bug in te-fl-attention's probe: please report it with this message; "
                 "force another backend meanwhile")  # fmt: skip
    return ProbeResult(backend, False, (why,), "probe", "probe raised")


def _default_probes(graph: bool = True) -> tuple[Probe, ...]:
    """:func:`default_probes`, with the probes that can use the Triton interpreter allowed to
    when ``TRITON_INTERPRET`` is set (read here: probes read no environment)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return default_probes(graph=graph, interpret=interpret)


def _graph_from_env() -> bool:
    """Whether the default probes build cuDNN graphs (``TE_FL_ATTN_CUDNN_PROBE``, default 1)."""
    return os.environ.get("TE_FL_ATTN_CUDNN_PROBE", "1") != "0"


def default_key_space() -> Any:
    """The :class:`~.cache.keys.KeySpace` of the probes the process-wide selector would use (for
    showing keys without opening the cache)."""
    from .cache.keys import KeySpace

    if _DEFAULT is not None and _DEFAULT_FOR == backends.version():
        return _DEFAULT.keys
    return KeySpace(_default_probes(graph=_graph_from_env()))


_DEFAULT: Selector | None = None
_DEFAULT_FOR = -1  # the registry version it was built for


def default_selector() -> Selector:
    """The process-wide selector (created on first use, and again with the same cache when a
    backend is registered or removed). ``TE_FL_ATTN_CUDNN_PROBE=0`` keeps FusedAttention at its
    rule stage (no cuDNN graph builds); ``TRITON_INTERPRET=1`` lets the Triton candidate run in
    the interpreter on a machine without a GPU. It also makes the probe cache the store of our
    Triton kernel's tuned tiles (:func:`.cache.tuning.install`), so a warm job never autotunes."""
    global _DEFAULT, _DEFAULT_FOR
    sel = _DEFAULT
    if sel is None or _DEFAULT_FOR != backends.version():
        from .cache import tuning
        from .cache.tiered import default_cache

        graph = _graph_from_env()
        cache = sel.cache if sel is not None else default_cache()
        if sel is None:
            tuning.install(cache)
        sel = Selector(_default_probes(graph=graph), cache=cache)
        _DEFAULT, _DEFAULT_FOR = sel, backends.version()
    return sel


def select(config: FusedAttnConfig, device: DeviceProfile | str | None = None,
           policy: Policy | None = None, force: str | None = None) -> Decision:  # fmt: skip
    """Choose a backend; raises :class:`NoBackendError` listing every candidate's reasons."""
    return default_selector().select(config, device, policy, force)


def explain(config: FusedAttnConfig, device: DeviceProfile | str | None = None,
            policy: Policy | None = None, force: str | None = None, *,
            show_graph: bool = False) -> Decision:  # fmt: skip
    """The full decision with every candidate's reasons, also when nothing is supported.
    ``show_graph``: also ``detail["graph_spec"]``, the cuDNN graphs FusedAttention's probe
    builds (:meth:`Selector.graph_spec`)."""
    sel = default_selector()
    decision = sel.decide(config, device, policy, force)
    if show_graph:
        decision = dataclasses.replace(decision, detail={
            **decision.detail, "graph_spec": sel.graph_spec(config, decision.device)})
    return decision
