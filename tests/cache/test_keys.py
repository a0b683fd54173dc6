"""Cache keys: stable across processes; any software change is a miss, never a wrong hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cache_testutil import result

import te_fl_attention
from te_fl_attention.cache import PROBE_SCHEMA, CacheKey, ProbeCache, package_version, versions_key
from te_fl_attention.cache import keys as keys_mod
from te_fl_attention.cache.keys import KeySpace
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes import default_probes
from te_fl_attention.selector import Selector

SPACE = KeySpace(default_probes(graph=False))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(te_fl_attention.__file__)))
CHILD = """
import json, sys
from te_fl_attention.cache import ProbeCache
from te_fl_attention.cache.keys import KeySpace
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes import default_probes
from te_fl_attention.reasons import ProbeResult
cfg = FusedAttnConfig(num_heads=32, num_gqa_groups=8, head_dim_qk=128, max_seqlen_q=4096,
                      attn_mask_type="causal", dtype="bf16")
dev = profile("h100")
key = KeySpace(default_probes(graph=False)).key(cfg, "fused", dev)
ProbeCache(sys.argv[1]).put(key, ProbeResult("fused", True), config=cfg, device=dev)
print(json.dumps(key))
"""


def test_same_config_from_two_processes_is_one_row(tmp_path):
    path = str(tmp_path / "k.sqlite")
    keys = []
    for seed in ("1", "2"):  # different hash seeds: keys must not depend on hash()
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                             env=env, check=True)  # fmt: skip
        keys.append(tuple(json.loads(out.stdout)))
    assert keys[0] == keys[1]
    cache = ProbeCache(path)
    assert len(cache) == 1
    cfg = FusedAttnConfig(num_heads=32, num_gqa_groups=8, head_dim_qk=128, max_seqlen_q=4096,
                          attn_mask_type="causal", dtype="bf16")  # fmt: skip
    here = SPACE.key(cfg, "fused", profile("h100"))
    assert tuple(here) == keys[0] and cache.get(here) is not None


def test_any_version_change_misses(store):
    dev = profile("h100")
    cfg = FusedAttnConfig()
    k = SPACE.key(cfg, "flash", dev)
    store.put(k, result(1, "flash"))
    assert store.get(k) == result(1, "flash")
    env = SPACE.env()
    changed = [
        SPACE.key(cfg, "flash", dev.with_overrides({"cudnn": "9.10.0"})),
        SPACE.key(cfg, "flash", dev.with_overrides({"flash_attn": "none"})),
        k._replace(versions_key=versions_key(dev, PROBE_SCHEMA + 1, probe_env=env)),
        k._replace(versions_key=versions_key(dev, package="9.9.9", probe_env=env)),
        SPACE.key(cfg, "flash", dev, stage="verify"),  # a stage's own rows
        KeySpace(default_probes(graph=True)).key(cfg, "flash", dev),  # other probe settings
        SPACE.key(cfg, "flash", profile("h200")),  # different hardware
        SPACE.key(cfg.replace(dropout=0.1), "flash", dev),  # different config
    ]
    assert len({c for c in changed} | {k}) == len(changed) + 1
    for c in changed:
        assert store.get(c) is None


def test_package_version_is_part_of_the_key(monkeypatch):
    dev = profile("a100")
    before = versions_key(dev)
    monkeypatch.setattr(keys_mod, "package_version", lambda: "0.2.0")
    assert versions_key(dev) != before
    assert versions_key(dev, package=package_version()) != versions_key(dev, package="0.2.0")


def test_package_version_fallback(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    keys_mod.package_version.cache_clear()
    monkeypatch.setattr(metadata, "version", missing)
    try:
        assert keys_mod.package_version() == getattr(te_fl_attention, "__version__", "0+unknown")
    finally:
        keys_mod.package_version.cache_clear()


def test_key_validation():
    good = CacheKey("a" * 64, "fa3", "b" * 64, "c" * 64)
    assert good.check() is good
    for bad in (good._replace(config_key="A" * 64), good._replace(device_fp="b" * 63),
                good._replace(backend="cuda"), good._replace(versions_key=None)):  # fmt: skip
        assert bad.problem()
        with pytest.raises(ValueError):
            bad.check()


def test_the_selector_stores_rows_under_the_key_space_keys():
    """One function builds keys: a KeySpace over the same probes names the selector's rows."""
    from te_fl_attention.cache import MemoryCache

    cache = MemoryCache()
    sel = Selector(default_probes(graph=False), cache=cache)
    cfg, dev = FusedAttnConfig(), profile("h100")
    sel.decide(cfg, dev)
    stored = {r.key for r in cache.iter_rows()}
    assert stored == set(SPACE.keys(cfg, dev, ["fused", "flash", "triton", "unfused"]).values())
    assert sel.keys.versions(dev) == SPACE.versions(dev)
