"""agree() in real multi-process gloo groups: one probe per (config, device type), the same
collectives on every rank whatever its cache holds, local and uniform agreement."""

from __future__ import annotations

import json

import pytest
from fleet_testutil import HERE, run_ranks

from te_fl_attention import FusedAttnConfig, NoBackendError, Policy, Selector
from te_fl_attention.cache import MemoryCache
from te_fl_attention.fleet import agree, agree_from_env, agreed, dist_ready
from te_fl_attention.probes import default_probes

CANDIDATES = 4  # a "probe" of one config is one result per candidate


def _job(scenario, tmp_path, world=4, timeout=150):
    init = f"file://{tmp_path / 'rendezvous'}"
    run_ranks(lambda r: [str(HERE / "agree_worker.py"), scenario, str(r), str(world), init,
                         str(tmp_path)], world, timeout)  # fmt: skip
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """4 ranks: a100, h100 (no flash-attn), a100, h100; rank 2 warm for the first call, rank 0
    (the a100 prober) warm for the second."""
    return _job("mixed", tmp_path_factory.mktemp("mixed"))


def test_collectives_do_not_depend_on_cache_hits(mixed):
    for rank in mixed:
        for call in ("local", "uniform", "none"):
            assert rank[call]["collectives"] == 2, (rank["rank"], call)


def test_one_probe_per_config_and_device_type(mixed):
    probes = [r["local"]["probes"] for r in mixed]
    assert probes == [6 * CANDIDATES, 6 * CANDIDATES, 0, 0]  # rank 2's warm cache is not used
    probes = [r["uniform"]["probes"] for r in mixed]
    assert probes == [0, 4 * CANDIDATES, 0, 0]  # the a100 prober answered from its cache
    # every rank's cache now holds every type's results: a fresh selector probes nothing
    assert [r["reprobes"] for r in mixed] == [0, 0, 0, 0]


def test_local_mode_each_type_its_best_and_one_warning(mixed):
    for r in mixed:
        chosen = {(d[0], d[1]) for d in r["local"]["decisions"]}
        assert chosen == ({("flash", "fa2")} if r["device"] == "a100" else {("fused", None)})
    assert mixed[1]["local"]["decisions"][0][2] == "probe"
    warnings = [r["local"]["warnings"] for r in mixed]
    assert [len(w) for w in warnings] == [1, 0, 0, 0]
    text = warnings[0][0]
    assert "a100 -> FlashAttention 2" in text and "h100 -> FusedAttention" in text
    assert "on h100, FlashAttention:" in text and "not" in text  # why flash is out on h100


def test_uniform_mode_same_decision_everywhere(mixed):
    chosen = [[(d[0], d[1]) for d in r["uniform"]["decisions"]] for r in mixed]
    assert all(c == chosen[0] for c in chosen)
    # d64/96/128: FusedAttention runs on both; d256 training: cuDNN refuses it on sm80, so our
    # Triton kernel (2nd on a100, 3rd on h100) beats unfused
    assert chosen[0] == [("fused", None)] * 3 + [("triton", None)]


def test_uniform_without_a_common_backend_raises_on_every_rank(mixed):
    for r in mixed:
        msg = r["none"]["error"]
        assert "no attention backend is supported on every device type" in msg
        assert "a100" in msg and "h100" in msg and "FusedAttention" in msg


def test_ranks_may_pass_different_configs(mixed):
    local = [r["ragged_local"] for r in mixed]
    uniform = [r["ragged_uniform"] for r in mixed]
    assert all(len(x["decisions"]) == 2 and x["collectives"] == 2 for x in local + uniform)
    assert [len(x["warnings"]) for x in local] == [1, 0, 0, 0]  # new configs, new divergence
    # local: each type probes the configs of its own ranks (shared + 2 own) once
    assert [x["probes"] for x in local] == [3 * CANDIDATES, 3 * CANDIDATES, 0, 0]
    # uniform: each type probes every rank's configs (shared + 4 own) once
    assert [x["probes"] for x in uniform] == [5 * CANDIDATES, 5 * CANDIDATES, 0, 0]
    assert len({json.dumps(x["decisions"][0][:2]) for x in uniform}) == 1


def test_graph_probing_mixed_job(tmp_path):
    ranks = _job("graph", tmp_path)
    for r in ranks:
        assert r["local"]["collectives"] == r["uniform"]["collectives"] == 2
        for d in r["local"]["decisions"]:
            fused = next(x for x in d[3] if x[0] == "fused")
            assert fused[2] == "graph_build"  # cuDNN itself answered (deviceless)
    assert sum(r["local"]["probes"] for r in ranks) == 2 * 2 * CANDIDATES
    assert sum(r["uniform"]["probes"] for r in ranks) == 0
    assert len({json.dumps(r["uniform"]["decisions"][0][:2]) for r in ranks}) == 1


def test_agree_without_a_process_group_is_local():
    sel = Selector(default_probes(graph=False), cache=MemoryCache())
    configs = [FusedAttnConfig(), FusedAttnConfig(head_dim_qk=128)]
    assert not dist_ready() and agreed(configs[0], "h100") is None
    ds = agree(configs, mode="uniform", device="h100", selector=sel)
    assert [d.chosen for d in ds] == ["fused", "fused"]
    assert agreed(configs[1], "h100") is ds[1]  # the plugin's lookup: never a collective
    assert ds[0].detail["agreement"]["types"] == {"h100": [0]}
    with pytest.raises(NoBackendError):
        agree([FusedAttnConfig(dtype="fp32")], mode="uniform", device="t4", selector=sel,
              policy=Policy(unfused=False))
    with pytest.raises(ValueError):
        agree(configs, mode="sometimes", selector=sel)


def test_agree_from_env():
    assert agree_from_env({}) is None
    assert agree_from_env({"TE_FL_ATTN_AGREE": "off"}) is None
    assert agree_from_env({"TE_FL_ATTN_AGREE": "Uniform"}) == "uniform"
    assert agree_from_env({"TE_FL_ATTN_AGREE": "local"}) == "local"
    with pytest.raises(ValueError, match="TE_FL_ATTN_AGREE"):
        agree_from_env({"TE_FL_ATTN_AGREE": "always"})
