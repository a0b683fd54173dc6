"""Tile tuning of the Triton kernel (issue 10, defect 11): keys with sequence-length buckets and
feature flags, choices remembered in the probe cache, stored choices validated.

The GPU branch runs on CPU through ``gpu_launches`` (fake H100 + launch double); a
:class:`~launch_double.VirtualClock` with a cost model makes timing deterministic where a test
needs a particular winner.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from launch_double import LaunchLog, VirtualClock, installed  # noqa: E402
from test_triton_flash import BF16, check, make_case  # noqa: E402

from te_fl_attention.cache import tuning as cache_tuning  # noqa: E402
from te_fl_attention.cache.sqlite import ProbeCache  # noqa: E402
from te_fl_attention.kernels import triton_flash as tf  # noqa: E402
from te_fl_attention.kernels import tuning  # noqa: E402
from te_fl_attention.kernels.tuning import Config, MemoryTuningStore, Tuner  # noqa: E402

pytestmark = pytest.mark.skipif(
    not tf.interpreting(), reason="these CPU tests need TRITON_INTERPRET=1 at triton import"
)
HERE = Path(__file__).resolve().parent


def tile_cost(launch) -> float:
    """Cost model of the double: each program pays a fixed 1 ms plus its tile area / 2048 (big
    tiles waste work on short sequences, small ones pay the per-program cost many times)."""
    m = launch.meta
    return launch.grid[0] * (1.0 + m["BLOCK_M"] * m.get("BLOCK_N", 1) / 2048)


def cheapest(kernel: str, rows: int, batch_heads: int, d: int) -> tuple:
    """The kept tile the cost model makes fastest for ``rows`` (computed here, independently)."""
    def cost(c: Config) -> float:
        block = c.block_n if kernel == "dkdv" else c.block_m
        return math.ceil(rows / block) * batch_heads * (1.0 + c.block_m * c.block_n / 2048)

    best = min(tf.configs(kernel, BF16, d, d), key=cost)
    return best.block_m, best.block_n, best.num_warps, best.num_stages


@pytest.fixture
def timed_launches(fake_gpu, monkeypatch):
    """``gpu_launches`` with virtual time: tuning picks the cost model's cheapest tile."""
    clock = VirtualClock()
    with installed(monkeypatch, LaunchLog(cost=tile_cost, clock=clock)) as log:
        yield log


def test_tiny_run_does_not_fix_the_tile_for_4096_tokens(timed_launches):
    log = timed_launches
    q, k, v, do, kw = make_case(dtype=BF16, b=1, sq=16, skv=16, h=2, dqk=16)
    check(q, k, v, do, attn_mask_type="causal", **kw)  # the tiny run, checked for real
    tiny = log.of("fwd")[-1].config
    assert tiny == cheapest("fwd", 16, 2, 16)
    log.execute = False  # 4096 tokens: far too slow for the interpreter; tiles only
    long_q = torch.zeros(1, 4096, 2, 16, dtype=BF16)
    tf.flash_attention(long_q, long_q, long_q, attn_mask_type="causal")
    long = log.of("fwd")[-1].config
    assert long == cheapest("fwd", 4096, 2, 16) != tiny
    keys = [key for how, key, _ in tuning.tuner().events if how == "tuned" and key.kernel == "fwd"]
    assert [(key.rows_q, key.rows_kv) for key in keys] == [(64, 64), (4096, 4096)]


def test_tuning_key_has_buckets_and_feature_flags(gpu_launches):
    gpu_launches.execute = False
    q = torch.zeros(1, 100, 4, 16, dtype=BF16)
    kv = torch.zeros(1, 100, 2, 16, dtype=BF16)
    tf.flash_attention(q, kv, kv, attn_mask_type="causal", window_size=(31, 0))
    tf.flash_attention(q, kv, kv, attn_mask_type="no_mask")
    keys = [key for how, key, _ in tuning.tuner().events if how == "tuned"]
    a, b = keys
    assert (a.rows_q, a.rows_kv, a.programs, a.group) == (128, 128, 4, 2)
    assert a.causal and a.window_left and a.window_right and a.window_span == 32
    assert not (b.causal or b.window_left or b.window_right) and b.window_span == 0
    assert a.device == gpu_launches.gpu.props().name and a.sm == 90 and a.dtype == "bf16"
    assert a.code == tf.code_digest() and len(a.digest()) == 64
    assert tuning.bucket(1) == 64 and tuning.bucket(4097) == 8192 and tuning.bucket(10**6) == 16384


def test_poisoned_stored_choice_is_ignored(gpu_launches, tmp_path):
    cache = ProbeCache(tmp_path / "probes.sqlite")
    store = cache_tuning.install(cache)
    try:
        q, k, v, do, kw = make_case(dtype=BF16, b=1, sq=16, skv=16, h=1, dqk=16)
        check(q, k, v, do, attn_mask_type="causal", **kw)
        keys = [key for how, key, _ in tuning.tuner().events if how == "tuned"]
        assert len(keys) == 3 and all(store.get(key) for key in keys)
        poison = [{"config": {"block_m": 256, "block_n": 256, "num_warps": 8, "num_stages": 9}},
                  {"config": "fastest"}, {"nothing": 1}]  # fmt: skip
        for key, bad in zip(keys, poison, strict=True):
            store.put(key, bad)
        tuning.set_store(store)  # forgets the in-process memo, as a new process would
        before = tuning.tuner().benchmarks
        gpu_launches.launches.clear()
        check(q, k, v, do, attn_mask_type="causal", **kw)
        events = [how for how, _, _ in tuning.tuner().events]
        assert events.count("ignored") == 3 and events.count("tuned") == 6
        assert tuning.tuner().benchmarks > before
        assert all(x.config[0] <= 128 and x.config[3] <= 3 for x in gpu_launches.launches
                   if x.config)  # fmt: skip
        for key in keys:  # re-tuned and stored again
            kept = tf.configs(key.kernel, BF16, 16, 16)
            assert Config.from_dict(store.get(key)["config"]) in kept
    finally:
        cache_tuning.uninstall()
        cache.close()


def test_tuner_validates_what_any_store_returns(monkeypatch):
    key = tuning.TuneKey(kernel="fwd", device="x", sm=90, sm_count=132, memory_gib=80.0,
                         code="c", dtype="bf16", d_qk=64, d_v=64, causal=False,
                         window_left=False, window_right=False, window_span=0,
                         bottom_right=False, lens=False, varlen=False, group=1,
                         gqa_split=False, rows_q=64, rows_kv=64, programs=1)  # fmt: skip
    cands = (Config(64, 64, 4, 3), Config(32, 32, 4, 1))
    monkeypatch.setattr(tuning, "time_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    good = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
    for stored, tunes in (
        ({"config": good}, False),
        ({"config": {**good, "num_stages": True}}, True),  # a bool is not a stage count
        ({"config": {**good, "block_m": 16}}, True),  # well formed, but not kept
        ({"config": {**good, "extra": 1}}, True),
        ("garbage", True),
    ):
        store = MemoryTuningStore()
        store._rows[key.canonical()] = stored  # what a damaged or foreign store could hold
        t = Tuner(store)
        got = t.choose(key, cands, lambda cfg: None)
        assert got in cands
        assert (t.benchmarks > 0) == tunes, stored
        assert got == (Config(32, 32, 4, 1) if not tunes else cands[0])


def test_warm_cache_second_process_does_no_benchmarking(fake_gpu, tmp_path):
    env = fake_gpu.child_env()
    env["TE_FL_ATTN_CACHE"] = str(tmp_path / "probes.sqlite")
    env["TRITON_INTERPRET"] = "1"
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(HERE / "child_tuning.py")], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["benchmarks"] > 0 and cold["tunings"] == 3 and set(cold["events"]) == {"tuned"}
    assert warm["benchmarks"] == 0 and warm["tunings"] == 0
    assert warm["events"] == ["stored"] * 3
    assert warm["launched"] == cold["launched"]
    assert cold["max_err"] < 0.05 and warm["max_err"] < 0.05
    with ProbeCache(tmp_path / "probes.sqlite") as cache:  # three valid probe-cache rows
        rows = list(cache.iter_rows())
    assert len(rows) == 3
    for row in rows:
        assert row.key.backend == "triton" and row.key.problem() is None
        detail = row.result["detail"]
        assert detail["kind"] == "triton_tune" and detail["key"]["kernel"] in ("fwd", "dq", "dkdv")
        assert row.key.config_key == tuning.TuneKey(**detail["key"]).digest()


def test_install_is_idempotent_and_uninstall_restores_memory():
    try:
        first = cache_tuning.install()
        assert cache_tuning.install() is first and tuning.get_store() is first
    finally:
        cache_tuning.uninstall()
    assert isinstance(tuning.get_store(), MemoryTuningStore)
