"""The Redis tier (cache/remote.py) against a real redis-server: sharing between processes with
separate local stores, write-back, versioned JSON keys, and Redis dying mid-run (a miss, one
warning)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from child_env import child_env

from te_fl_attention import FusedAttnConfig, Selector
from te_fl_attention.cache import CacheKey, MemoryCache, ProbeCache, open_cache
from te_fl_attention.cache.remote import FORMAT_VERSION, RedisTier
from te_fl_attention.cache.tiered import TieredCache
from te_fl_attention.device import profile
from te_fl_attention.fleet import VERIFIED, plan
from te_fl_attention.probes import default_probes

CONFIGS = [FusedAttnConfig(head_dim_qk=hd, num_heads=8) for hd in (64, 96, 128)]


@pytest.fixture(autouse=True)
def _no_remote_tier_unless_set(monkeypatch) -> None:
    """No remote tier and no agreement unless a test sets one (the conftest isolates the cache)."""
    monkeypatch.delenv("TE_FL_ATTN_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("TE_FL_ATTN_AGREE", raising=False)


def _redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "install", "-y", "-qq", "redis-server"],
                    ["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "redis-server"]):  # fmt: skip
            ok = subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode == 0
            if ok and cmd[1] == "install":
                break
        exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed and could not be installed here: "
                    "run `apt-get install -y redis-server` (CI installs it)")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            import redis
        except ImportError:
            self.stop()
            pytest.fail("redis-py is not installed: pip install 'te-fl-attention[redis]'")
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.fail("redis-server did not start")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def cache_log():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("te_fl_attention.cache")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _remote_warnings(records):
    return [r for r in records if r.levelno >= logging.WARNING and "remote" in r.getMessage()]


_CHILD = """
import json, sys
from te_fl_attention import FusedAttnConfig
from te_fl_attention.cache import default_cache
from te_fl_attention.selector import default_selector
sel = default_selector()
for hd in (64, 96, 128):
    sel.decide(FusedAttnConfig(head_dim_qk=hd, num_heads=8), "h100")
print(json.dumps({"stats": sel.stats, "local": len(default_cache().local),
                  "cache": type(default_cache()).__name__}))
"""


def test_two_processes_with_separate_stores_share_through_redis(server, tmp_path):
    def run(name):
        env = child_env(TE_FL_ATTN_CACHE=str(tmp_path / name / "probes.sqlite"),
                        TE_FL_ATTN_REMOTE_CACHE=server.url, TE_FL_ATTN_CUDNN_PROBE="0")
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run("a"), run("b")
    assert first["cache"] == "TieredCache"
    assert first["stats"]["probes"] == 3 * 4 and first["stats"]["cache_hits"] == 0
    assert second["stats"]["probes"] == 0 and second["stats"]["cache_hits"] == 3 * 4
    assert second["local"] == 3 * 4  # read-through results were written back to b's store
    keys = server.client.keys(f"te-fl-attn:v{FORMAT_VERSION}:r:*")
    assert len(keys) == 3 * 4


def test_keys_are_versioned_and_values_are_json(server, tmp_path):
    tier = RedisTier(server.url)
    cache = TieredCache(ProbeCache(tmp_path / "s.sqlite"), tier)
    sel = Selector(default_probes(graph=False), cache=cache)
    decision = sel.decide(CONFIGS[0], "h100")
    dev = profile("h100")
    from te_fl_attention.cache.keys import versions_key

    vk = versions_key(dev, probe_env=sel.probe_env())
    key = CacheKey(CONFIGS[0].key(), "fused", dev.fingerprint(), vk)
    raw = server.client.get(tier.key(key))
    assert tier.key(key) == (f"te-fl-attn:v{FORMAT_VERSION}:r:{key.config_key}:fused:"
                             f"{key.device_fp}:{key.versions_key}")  # fmt: skip
    assert json.loads(raw) == decision.result("fused").to_dict()  # JSON, never pickle
    # a damaged value reads as a miss, not an error
    server.client.set(tier.key(key), b"\x80not json")
    assert RedisTier(server.url).get_many([key]) == {}
    cache.close()


def test_redis_killed_mid_run_selection_continues_with_one_warning(server, cache_log):
    tier = RedisTier(server.url)
    sel = Selector(default_probes(graph=False), cache=TieredCache(MemoryCache(), tier))
    assert sel.decide(CONFIGS[0], "h100").chosen == "fused"
    assert tier.stats["puts"] == 4 and not tier.disabled
    server.stop()
    for config in CONFIGS[1:]:
        for dev in ("h100", "a100"):
            assert sel.decide(config, dev).chosen is not None
    assert tier.disabled
    assert len(_remote_warnings(cache_log)) == 1
    assert "off for this process" in _remote_warnings(cache_log)[0].getMessage()


def test_unreachable_redis_is_a_miss(cache_log, monkeypatch, tmp_path):
    monkeypatch.setenv("TE_FL_ATTN_REMOTE_CACHE", f"redis://127.0.0.1:{_free_port()}/0")
    cache = open_cache(tmp_path / "p.sqlite")
    assert isinstance(cache, TieredCache)
    t0 = time.monotonic()
    sel = Selector(default_probes(graph=False), cache=cache)
    for config in CONFIGS:
        assert sel.decide(config, "b200").chosen == "fused"
    assert time.monotonic() - t0 < 5
    assert len(_remote_warnings(cache_log)) == 1
    assert len(cache) == 3 * 4  # the local store still works
    cache.close()


def test_open_cache_tiers(monkeypatch, tmp_path, cache_log):
    monkeypatch.setenv("TE_FL_ATTN_REMOTE_CACHE", "off")
    assert isinstance(open_cache(tmp_path / "a.sqlite"), ProbeCache)
    monkeypatch.setenv("TE_FL_ATTN_REMOTE_CACHE", "http://example.invalid/")
    cache = open_cache("off")
    assert isinstance(cache, TieredCache) and cache.remote.disabled
    assert isinstance(cache.local, MemoryCache) and cache.mode == "memory"
    assert len(_remote_warnings(cache_log)) == 1


def test_fleet_plan_sees_real_gpu_rows_through_redis(server, tmp_path):
    """A real H100 somewhere wrote its results to Redis; a planner elsewhere marks them
    verified (rows are replayed through the planner's policy)."""
    real = profile("h100").with_overrides({"cudnn": "9.28.1"})
    real = dataclasses.replace(real, name="NVIDIA H100 80GB HBM3", source="local",
                               memory_gib=79.1)
    writer = TieredCache(ProbeCache(tmp_path / "gpu.sqlite"), RedisTier(server.url))
    sel = Selector(default_probes(graph=False), cache=writer)
    config = CONFIGS[1]
    raw, _ = sel.probe_all(config, profile("h100"))
    from te_fl_attention.cache.keys import versions_key

    vk = versions_key(real, probe_env={"machine": "gpu-node-7"})
    rows = []
    for r in raw:
        if r.backend == "fused":  # what a real graph build leaves
            r = dataclasses.replace(r, stage="graph_build", evidence="cudnn 9.28.1 graph (real)")
        rows.append((CacheKey(config.key(), r.backend, real.fingerprint(), vk), r,
                     config.to_dict(), real.to_dict()))
    writer.put_many(rows)
    writer.close()

    reader = TieredCache(ProbeCache(tmp_path / "laptop.sqlite"), RedisTier(server.url))
    p = plan({"cfg": config}, ["h100", "a100"],
             selector=Selector(default_probes(graph=False), cache=reader))
    assert p.cell("cfg", "h100").status == VERIFIED
    assert "NVIDIA H100 80GB HBM3" in p.cell("cfg", "h100").evidence
    assert p.cell("cfg", "a100").status == "predicted"
    reader.close()


# ------------------------------------------------------------------ values are validated (#12)
def _seed(server, tmp_path):
    """A tier with one real fused row for CONFIGS[0] on h100; returns (tier, key, value)."""
    tier = RedisTier(server.url)
    cache = TieredCache(ProbeCache(tmp_path / "seed.sqlite"), tier)
    sel = Selector(default_probes(graph=False), cache=cache)
    sel.decide(CONFIGS[0], "h100")
    cache.close()
    (raw_key,) = [k for k in server.client.keys(f"te-fl-attn:v{FORMAT_VERSION}:r:*")
                  if b":fused:" in k]  # fmt: skip
    _, _, ck, backend, fp, vk = raw_key.decode().rsplit(":", 5)
    key = CacheKey(ck, backend, fp, vk)
    return key, json.loads(server.client.get(raw_key))


@pytest.mark.parametrize("field, value", [
    ("elapsed_ms", "9" * 400),      # a 400-digit number: OverflowError before
    ("elapsed_ms", "1e400"),        # Infinity
    ("elapsed_ms", "NaN"),
    ("supported", '"false"'),       # a string is not a boolean (it read as true before)
    ("reasons", '[{"code": 5, "message": "x"}]'),
])  # fmt: skip
def test_invalid_redis_values_are_misses_with_one_warning(server, tmp_path, cache_log, field,
                                                          value):  # fmt: skip
    key, good = _seed(server, tmp_path)
    tier = RedisTier(server.url)
    text = json.dumps(good).replace(f'"{field}": ' + json.dumps(good[field]),
                                    f'"{field}": {value}', 1)  # fmt: skip
    assert text != json.dumps(good)
    server.client.set(tier.key(key), text)
    local = ProbeCache(tmp_path / "reader.sqlite")
    cache = TieredCache(local, tier)
    assert cache.get_many([key]) == {}  # a miss, no traceback
    assert cache.get_many([key]) == {}
    assert tier.stats["bad"] == 2 and not tier.disabled
    warnings = [r for r in _remote_warnings(cache_log) if "invalid value" in r.getMessage()]
    assert len(warnings) == 1
    assert len(local) == 0  # nothing copied into the local store
    cache.close()


def test_a_50mb_redis_value_is_refused_not_copied(server, tmp_path, cache_log):
    key, good = _seed(server, tmp_path)
    tier = RedisTier(server.url)
    good["evidence"] = "x" * (50 * 2**20)
    server.client.set(tier.key(key), json.dumps(good))
    local = ProbeCache(tmp_path / "reader.sqlite")
    cache = TieredCache(local, tier)
    assert cache.get_many([key]) == {}
    assert len(local) == 0 and tier.stats["bad"] == 1
    assert any("bytes (limit" in r.getMessage() for r in _remote_warnings(cache_log))
    cache.close()


def test_a_bad_context_record_does_not_break_the_write_back(server, tmp_path):
    key, good = _seed(server, tmp_path)
    tier = RedisTier(server.url)
    ctx_key = tier._ctx_key(key.device_fp, key.versions_key)
    server.client.set(ctx_key, json.dumps({"device": 5, "package_version": "x",
                                           "created_at": 1.0}))  # fmt: skip
    local = ProbeCache(tmp_path / "reader.sqlite")
    cache = TieredCache(local, tier)
    hit = cache.get_many([key])  # "device": 5 was a TypeError in store._as_dict
    assert key in hit and hit[key].backend == "fused"
    assert local.get(key) == hit[key] and local.get_row(key).device is None
    assert tier.stats["bad"] == 1
    cache.close()


def test_redis_strings_are_cleaned_and_far_future_contexts_refused(server, tmp_path):
    key, good = _seed(server, tmp_path)
    tier = RedisTier(server.url)
    good["evidence"] = "ok \x1b]52;c;ZXZpbA==\x07 \ud800 end"
    server.client.set(tier.key(key), json.dumps(good))
    server.client.set(tier._ctx_key(key.device_fp, key.versions_key),
                      json.dumps({"device": None, "package_version": "x",
                                  "created_at": time.time() + 10 * 365 * 86400}))  # fmt: skip
    cache = TieredCache(MemoryCache(), tier)
    hit = cache.get_many([key])[key]
    assert hit.evidence == "ok \ufffd]52;c;ZXZpbA==\ufffd \ufffd end"
    rows = tier.rows_for_config(key.config_key)
    assert rows and all(r.created_at <= time.time() + 300 for r in rows)
    assert tier.stats["bad"] >= 1
    cache.close()
