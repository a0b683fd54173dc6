"""The selector's persistent tier: a later process starts warm; any version change misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.cache import MemoryCache
from te_fl_attention.device import profile
from te_fl_attention.presets import preset

JOB = r"""
import json, sys
from te_fl_attention import FusedAttnConfig
from te_fl_attention.presets import preset
from te_fl_attention.selector import default_selector
sel = default_selector()
d = sel.decide(FusedAttnConfig(**preset("llama3-8b")), sys.argv[1])
print(json.dumps({"chosen": d.chosen, "source": d.source, "stats": sel.stats,
                  "fused": d.result("fused").to_dict()}))
"""


def job(tmp_path, device: str = "h100", **env: str) -> dict:
    e = {**os.environ, "TE_FL_ATTN_CACHE": str(tmp_path / "probes.sqlite"), **env}
    p = subprocess.run([sys.executable, "-c", JOB, device], capture_output=True, text=True,
                       env=e, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_second_job_starts_warm(tmp_path):
    cold = job(tmp_path)
    warm = job(tmp_path)
    assert cold["stats"]["probes"] == 4 and cold["source"] == "probe"
    assert warm["stats"] == {"memo_hits": 0, "cache_hits": 4, "probes": 0}
    assert warm["source"] == "cache" and warm["chosen"] == cold["chosen"] == "fused"
    assert warm["fused"] == cold["fused"]  # the stored result, byte for byte


def test_library_version_change_misses(tmp_path):
    job(tmp_path)
    other = job(tmp_path, "h100:torch=2.12.0")
    assert other["stats"]["probes"] == 4 and other["stats"]["cache_hits"] == 0


def test_cache_off_keeps_nothing(tmp_path):
    job(tmp_path, TE_FL_ATTN_CACHE="off")
    again = job(tmp_path, TE_FL_ATTN_CACHE="off")
    assert again["stats"]["probes"] == 4
    assert not (tmp_path / "probes.sqlite").exists()


def test_same_config_from_two_selectors_is_one_row_per_backend():
    cache = MemoryCache()
    cfg = FusedAttnConfig(**preset("llama3-8b"))
    for _ in range(2):
        Selector(cache=cache).decide(FusedAttnConfig(**cfg.to_dict()), profile("h100"), Policy())
    assert len(cache) == 4


@pytest.mark.parametrize("change", [{"cudnn": "9.20.0"}, {"flash_attn": "2.7.4"}])
def test_versions_key_covers_the_stack(change):
    cache = MemoryCache()
    cfg = FusedAttnConfig()
    s = Selector(cache=cache)
    s.decide(cfg, profile("h100"), Policy())
    s2 = Selector(cache=cache)
    s2.decide(cfg, profile("h100").with_overrides(change), Policy())
    assert s2.stats["cache_hits"] == 0 and len(cache) == 8


class _Recorder:
    """A cache that only answers misses and records what the selector asked of it."""

    def __init__(self, warm_up: bool) -> None:
        self.calls: list[str] = []
        if warm_up:
            self.warm_up = lambda: self.calls.append("warm_up")

    def __len__(self) -> int:
        self.calls.append("len")
        return 0

    def get_many(self, keys):
        self.calls.append("get_many")
        return {}

    def put_many(self, items) -> int:
        self.calls.append("put_many")
        return len(list(items))


@pytest.mark.parametrize("has_warm_up", [True, False])
def test_prepare_readies_the_store_without_looking_anything_up(has_warm_up):
    cache = _Recorder(has_warm_up)
    Selector(cache=cache).prepare(profile("h100"))  # type: ignore[arg-type]
    assert cache.calls == (["warm_up"] if has_warm_up else ["len"])


def test_first_decision_after_prepare_is_served_from_the_store(tmp_path):
    from te_fl_attention.cache import ProbeCache

    store = ProbeCache(tmp_path / "probes.sqlite")
    cfg = FusedAttnConfig(**preset("llama3-8b"))
    cold = Selector(cache=store).decide(cfg, profile("h100"), Policy())
    store.close()
    store = ProbeCache(tmp_path / "probes.sqlite")
    sel = Selector(cache=store)
    sel.prepare(profile("h100"))
    warm = sel.decide(FusedAttnConfig(**cfg.to_dict()), profile("h100"), Policy())
    assert sel.stats == {"memo_hits": 0, "cache_hits": 4, "probes": 0}
    assert warm.results == cold.results and warm.source == "cache"
    assert store._bad_rows == 0


def test_default_selector_keeps_tuned_triton_tiles_in_its_probe_cache(monkeypatch):
    """A warm job never autotunes: the process-wide selector makes its probe cache the store of
    the Triton kernel's tuned tiles."""
    from te_fl_attention import selector
    from te_fl_attention.cache.tuning import ProbeCacheTuningStore
    from te_fl_attention.kernels import tuning

    monkeypatch.setattr(selector, "_DEFAULT", None)
    before = tuning.get_store()
    try:
        sel = selector.default_selector()
        store = tuning.get_store()
        assert isinstance(store, ProbeCacheTuningStore) and store._cache is sel.cache
    finally:
        tuning.set_store(before if not isinstance(before, ProbeCacheTuningStore) else None)
