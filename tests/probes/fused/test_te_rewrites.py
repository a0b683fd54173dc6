"""The fused probe asks cuDNN about the inputs TE 2.20.2's fused query sees, after TE's own
rewrites, per family: ALiBi slopes as TE's post_scale_bias, thd with TE's bucketed token counts,
dBias from the bias tensor's dims (not its label), and context parallelism one query per step.

Each family checks the table's prediction (no cuDNN needed) and, where cudnn-frontend is
installed, cuDNN 9.28.1's deviceless verdict on TE's graphs (and that both agree: no rule drift).
``test_cp_steps_match_tes_own_function`` runs TE 2.20.2's ``cp_per_step_configs`` itself (read
from the installed package's source, no TE import)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from te_fl_attention import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.graphspec import options, roles
from te_fl_attention.probes.fused.cp import cp_steps
from te_fl_attention.probes.fused.cpp import _step_seqlens_kv
from te_fl_attention.probes.fused.mapping import derive
from te_fl_attention.probes.fused.probe import CudnnProbe
from te_fl_attention.probes.fused.table import _has_dbias

HAS_CUDNN = importlib.util.find_spec("cudnn") is not None
needs_cudnn = pytest.mark.skipif(not HAS_CUDNN, reason="needs the [cudnn] extra (CI installs it)")

B = dict(batch_size=2, num_heads=8, head_dim_qk=64, max_seqlen_q=128, dtype="bf16")
THD = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding")
GRAPH, TABLE = CudnnProbe(graph=True), CudnnProbe(graph=False)


def cfg(**kw) -> FusedAttnConfig:
    return FusedAttnConfig(**{**B, **kw})


def table(device: str, **kw):
    return TABLE.probe(cfg(**kw), profile(device))


def graph(device: str, **kw):
    r = GRAPH.probe(cfg(**kw), profile(device))
    assert "predicted" not in r.detail or not r.detail["predicted"], r.detail
    return r


@pytest.fixture(scope="module")
def worker():
    from te_fl_attention.probes.fused.worker import CudnnWorker

    w = CudnnWorker()
    yield w
    w.close()


def spec(worker, device: str, **kw):
    return worker.probe(cfg(**kw).to_dict(), device, spec=True)


# ------------------------------------------------------------------ 1. ALiBi slopes -> TE's bias
ALIBI_H = dict(bias_type="alibi", alibi_slopes_shape=(8,))
ALIBI_BH = dict(bias_type="alibi", alibi_slopes_shape=(2, 8))


@pytest.mark.parametrize("slopes", [ALIBI_H, ALIBI_BH], ids=["h", "bh"])
def test_alibi_slopes_bottom_right_predicted_as_tes_bias_graph(slopes):
    r = table("h100", attn_mask_type="causal_bottom_right", **slopes)
    assert not r.supported and r.reasons[0].code == "cudnn_table.bottom_right_bias_dropout"
    assert "post_scale_bias (TE's bias for the ALiBi slopes)" in r.reasons[0].message
    assert r.reasons[0].observed == ("causal_bottom_right", "post_scale_bias", 0.0)


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("slopes", [ALIBI_H, ALIBI_BH], ids=["h", "bh"])
def test_alibi_slopes_with_padding_predicted_supported(slopes, mask):
    # TE 2.20.2's C++ asks cuDNN about the post_scale_bias graph; cuDNN builds it with padding
    # (TE's pre-2.20 table refused post_scale_bias + padding itself; 2.20.2 no longer does).
    assert table("h100", attn_mask_type=mask, **slopes).supported
    assert table("h100", attn_mask_type=mask, bias_type="post_scale_bias",
                 bias_shape="1hss").supported  # fmt: skip


@needs_cudnn
@pytest.mark.parametrize("device", ["a100", "h100", "b200"])
def test_alibi_slopes_bottom_right_refused_by_cudnn_as_te_is(device):
    r = graph(device, attn_mask_type="causal_bottom_right", **ALIBI_H)
    assert not r.supported and r.stage == "graph_build"
    assert "Bottom right causal mask is only supported with is_bias=False" in r.reasons[0].message
    assert "rule_drift" not in r.detail  # the table predicted the same


@needs_cudnn
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("slopes", [ALIBI_H, ALIBI_BH], ids=["h", "bh"])
def test_alibi_slopes_with_padding_built_no_drift(slopes, mask):
    r = graph("h100", attn_mask_type=mask, **slopes)
    assert r.supported and r.stage == "graph_build" and "rule_drift" not in r.detail


@needs_cudnn
def test_alibi_slopes_graph_is_tes_bias_graph(worker):
    r = spec(worker, "h100", attn_mask_type="padding_causal", max_seqlen_kv=256, **ALIBI_BH)
    assert r["supported"], r
    d = r["derived"]
    # max_seqlen shapes, no grad asked but dBias built (TE's C++ decides from the dims)
    assert (d["bias"], d["alibi"], d["bias_dims"]) == (True, False, [2, 8, 128, 256])
    fwd, bwd = r["graph_spec"]["fwd"], r["graph_spec"]["bwd"]
    assert options(fwd)["alibi_mask"] is False and roles(fwd)["in Bias"]["dim"] == [2, 8, 128, 256]
    assert roles(bwd)["out dBias"]["dim"] == [2, 8, 128, 256]


# ------------------------------------------------------------------ 2. thd: TE's bucketed tokens
DECODE_SINK = dict(**THD, max_seqlen_q=1, softmax_type="off-by-one", is_training=False)
ONE_ONE = dict(**THD, max_seqlen_q=1, max_seqlen_kv=1, num_tokens_q=2, num_tokens_kv=2)


@pytest.mark.parametrize("kw", [DECODE_SINK, ONE_ONE], ids=["decode_sink", "s1_s1"])
def test_thd_one_token_graph_dims_are_tes_buckets(kw):
    c = cfg(**kw)
    assert c.num_tokens_q == 1024  # get_max_tokens(2) (kept bucketed by the config)
    d = derive(c, 90, 92801)
    assert (d.graph_max_seqlen_q, d.uses_ragged_graph) == (1024, True)
    assert table("h100", **kw).supported and table("b200", **kw).supported
    # sm120 has no ragged graph: the graph's s_q is max_seqlen_q = 1 and cuDNN's checks apply
    assert not table("rtx5090", **kw).supported


@needs_cudnn
@pytest.mark.parametrize("kw, words", [
    (DECODE_SINK, "decode only mode, i.e. s_q == 1, not supported with sink_token"),
    (ONE_ONE, "s_q = s_kv = 1 is not supported"),
], ids=["decode_sink", "s1_s1"])  # fmt: skip
def test_thd_one_token_cudnn_agrees_with_table(kw, words):
    for device in ("h100", "b200"):
        r = graph(device, **kw)
        assert r.supported and "rule_drift" not in r.detail, (device, r.reasons)
    r = graph("rtx5090", **kw)
    assert not r.supported and words in r.reasons[0].message
    assert "rule_drift" not in r.detail


# ------------------------------------------------------------------ 3. dBias from the bias dims
@pytest.mark.parametrize("kw, dims, dbias", [
    # b1ss with batch 1 and s_q 1 is a [1, 1, 1, s_kv] tensor: no dBias in TE's backward
    (dict(batch_size=1, max_seqlen_q=1, bias_shape="b1ss"), (1, 1, 1, 128), False),
    (dict(batch_size=1, max_seqlen_q=1, bias_shape="b1ss", bias_requires_grad=True),
     (1, 1, 1, 128), False),
    (dict(batch_size=1, num_heads=1, max_seqlen_q=1, bias_shape="bhss"), (1, 1, 1, 128), False),
    (dict(max_seqlen_q=1, bias_shape="11ss"), (1, 1, 1, 128), False),
    (dict(num_heads=1, bias_shape="1hss"), (1, 1, 128, 128), True),
    (dict(bias_shape="111s"), (1, 1, 1, 128), False),
    (dict(bias_shape="b1ss"), (2, 1, 128, 128), True),
], ids=["b1ss_b1_sq1", "b1ss_b1_sq1_grad", "bhss_b1_h1_sq1", "11ss_sq1", "1hss_h1", "111s",
        "b1ss"])  # fmt: skip
def test_dbias_follows_the_bias_tensor_dims(kw, dims, dbias):
    c = cfg(bias_type="post_scale_bias", max_seqlen_kv=128, **kw)
    assert derive(c, 90, 92801).bias_dims == dims
    assert _has_dbias(c) is dbias


@needs_cudnn
def test_dbias_graph_from_dims_b1ss_batch1_decode(worker):
    r = spec(worker, "h100", batch_size=1, max_seqlen_q=1, max_seqlen_kv=128,
             bias_type="post_scale_bias", bias_shape="b1ss", bias_requires_grad=True)
    assert r["supported"], r
    bwd = roles(r["graph_spec"]["bwd"])
    assert bwd["in Bias"]["dim"] == [1, 1, 1, 128] and "out dBias" not in bwd


@needs_cudnn
def test_blackwell_deterministic_bias_without_dbias_built():
    # deterministic sm100 backward refuses dBias; a [1, 1, 1, s_kv] bias (b1ss, b = s_q = 1)
    # carries none, so table and cuDNN both accept it
    kw = dict(batch_size=1, max_seqlen_q=1, max_seqlen_kv=256, bias_type="post_scale_bias",
              bias_shape="b1ss", deterministic=True)  # fmt: skip
    assert table("b200", **kw).supported
    r = graph("b200", **kw)
    assert r.supported and "rule_drift" not in r.detail


# ------------------------------------------------------------------ 4. context parallelism
CP = dict(context_parallel=True, cp_size=2, max_seqlen_q=4096)


def _steps(**kw):
    return [(s.label, s.config.attn_mask_type, s.config.max_seqlen_q, s.config.max_seqlen_kv,
             s.config.num_heads) for s in cp_steps(cfg(**CP, **kw))]  # fmt: skip


def test_cp_steps():
    assert cp_steps(cfg()) == ()
    assert _steps(cp_comm_type="p2p", attn_mask_type="causal") == [
        ("diagonal", "causal", 2048, 2048, 8), ("lower", "no_mask", 2048, 1024, 8),
        ("upper", "no_mask", 1024, 2048, 8)]  # fmt: skip
    assert _steps(cp_comm_type="p2p") == [("ring", "no_mask", 2048, 2048, 8)]
    assert _steps(cp_comm_type="a2a") == [("heads", "no_mask", 4096, 4096, 4)]
    assert _steps(cp_comm_type="all_gather", attn_mask_type="causal") == [
        ("chunk", "causal_bottom_right", 1024, 1024, 8),
        ("full", "causal_bottom_right", 1024, 4096, 8)]  # fmt: skip
    a2a_p2p = cp_steps(cfg(**{**CP, "cp_size": 4}, cp_comm_type="a2a+p2p"))
    assert [(s.config.max_seqlen_q, s.config.num_heads) for s in a2a_p2p] == [(2048, 4)]
    assert "cp_size_a2a=2 assumed" in a2a_p2p[0].notes[0]
    assert _step_seqlens_kv(cfg(**CP, cp_comm_type="p2p", attn_mask_type="causal")) == (2048,
                                                                                        1024)


def test_cp_thd_step_token_counts_and_bias_dims():
    steps = cp_steps(cfg(**CP, **{**THD, "attn_mask_type": "padding_causal"}))
    assert [(s.config.num_tokens_q, s.config.num_tokens_kv) for s in steps] == [
        (8192, 8192), (8192, 4096), (4096, 8192)]  # fmt: skip
    assert [s.config.attn_mask_type for s in steps] == ["padding_causal", "padding", "padding"]
    bias = cp_steps(cfg(**CP, attn_mask_type="causal", bias_type="post_scale_bias",
                        bias_shape="1hss"))  # fmt: skip
    assert [derive(s.config, 90, 92801).bias_dims for s in bias] == [
        (1, 8, 2048, 2048), (1, 8, 2048, 1024), (1, 8, 1024, 2048)]  # fmt: skip
    b111s = cp_steps(cfg(**CP, attn_mask_type="causal", bias_type="post_scale_bias",
                         bias_shape="111s"))  # fmt: skip
    assert [derive(s.config, 90, 92801).bias_dims for s in b111s][2] == (1, 1, 1, 2048)


def test_cp_table_predicts_per_step():
    r = table("h100", **CP, cp_comm_type="all_gather", attn_mask_type="causal", dropout=0.1)
    assert not r.supported
    assert r.reasons[0].code == "cudnn_table.bottom_right_bias_dropout"
    assert r.reasons[0].message.startswith("context-parallel step chunk (causal_bottom_right")
    ok = table("h100", **CP, cp_comm_type="p2p", attn_mask_type="causal")
    assert ok.supported and [s["label"] for s in ok.detail["cp_steps"]] == [
        "diagonal", "lower", "upper"]  # fmt: skip


def _te_cp_per_step_configs():
    spec_ = importlib.util.find_spec("transformer_engine")
    if spec_ is None or not spec_.submodule_search_locations:
        pytest.skip("TransformerEngine is not installed")
    path = (Path(list(spec_.submodule_search_locations)[0]) / "pytorch" / "attention"
            / "dot_product_attention" / "context_parallel.py")  # fmt: skip
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "cp_per_step_configs")  # fmt: skip
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return ns["cp_per_step_configs"]


@pytest.mark.parametrize("comm", ["p2p", "a2a", "all_gather", "a2a+p2p"])
@pytest.mark.parametrize("mask, thd", [
    ("no_mask", False), ("causal", False), ("padding", False), ("padding_causal", False),
    ("padding", True), ("padding_causal", True)])  # fmt: skip
def test_cp_steps_match_tes_own_function(comm, mask, thd):
    te_steps = _te_cp_per_step_configs()
    kw = dict(CP, cp_size=4, cp_comm_type=comm, attn_mask_type=mask, num_gqa_groups=4)
    if thd:
        kw.update(qkv_layout="thd_thd_thd", num_tokens_q=16384, num_tokens_kv=16384)
    c = cfg(**kw)
    a2a = 2 if comm == "a2a+p2p" else 1
    theirs = te_steps(comm, 4, a2a, max_seqlen_q=c.max_seqlen_q, max_seqlen_kv=c.max_seqlen_kv,
                      num_tokens_q=c.num_tokens_q or 0, num_tokens_kv=c.num_tokens_kv or 0,
                      num_heads=c.num_heads, num_gqa_groups=c.num_gqa_groups,
                      attn_mask_type=c.attn_mask_type, window_size=c.window_size,
                      bottom_right_diagonal=c.bottom_right_diagonal)  # fmt: skip
    ours = cp_steps(c)
    assert len(ours) == len(theirs)
    for s, t in zip(ours, theirs, strict=True):
        sc = s.config
        assert (sc.attn_mask_type, sc.max_seqlen_q, sc.max_seqlen_kv, sc.num_heads,
                sc.num_gqa_groups) == (t["attn_mask_type"], t["max_seqlen_q"], t["max_seqlen_kv"],
                                       t["num_attn_heads"], t["num_gqa_groups"])  # fmt: skip
        assert (sc.num_tokens_q or 0, sc.num_tokens_kv or 0) == (t["num_tokens_q"],
                                                                 t["num_tokens_kv"])
        assert s.params["window_size"] == [t["window_size_left"], t["window_size_right"]]
        assert s.params["bottom_right_diagonal"] == t["bottom_right_diagonal"]


@needs_cudnn
def test_cp_p2p_causal_builds_every_step():
    r = graph("h100", **CP, cp_comm_type="p2p", attn_mask_type="causal")
    assert r.supported and r.stage == "graph_build"
    steps = r.detail["cp_steps"]
    assert [(s["label"], s["max_seqlen_q"], s["max_seqlen_kv"], s["supported"]) for s in steps] \
        == [("diagonal", 2048, 2048, True), ("lower", 2048, 1024, True),
            ("upper", 1024, 2048, True)]  # fmt: skip
    assert all(s["plans"]["fwd"] and s["plans"]["bwd"] for s in steps)
    assert set(r.detail["plans"]) == {f"{g}[{s}]" for g in ("fwd", "bwd")
                                      for s in ("diagonal", "lower", "upper")}  # fmt: skip


@needs_cudnn
def test_cp_all_gather_dropout_refused_at_its_bottom_right_step():
    # all_gather turns the causal mask bottom-right per step; cuDNN refuses that with dropout
    # (TE then runs unfused). Before, CP was never built and the table said fused.
    r = graph("h100", **CP, cp_comm_type="all_gather", attn_mask_type="causal", dropout=0.1)
    assert not r.supported and r.stage == "graph_build"
    reason = r.reasons[0]
    assert reason.code == "cudnn.not_supported" and reason.observed == "chunk.fwd.validate"
    assert "context-parallel step chunk (causal_bottom_right, s_q=1024, s_kv=1024" in \
        reason.message  # fmt: skip
    assert [s["supported"] for s in r.detail["cp_steps"]] == [False, False]
    assert "rule_drift" not in r.detail


@needs_cudnn
def test_cp_a2a_graph_has_the_steps_heads(worker):
    r = spec(worker, "h100", **CP, cp_comm_type="a2a")
    assert r["supported"], r
    assert r["derived"]["heads"]["h"] == 4 and r["cp_steps"][0]["num_heads"] == 4
    assert set(r["graph_spec"]) == {"fwd[heads]", "bwd[heads]"}


def test_cp_step_with_no_tokens_is_predicted_refused():
    # s_q = 2 over all_gather's 2 * cp_size = 4 chunks: TE asks about s_q = 0
    r = table("h100", **{**CP, "max_seqlen_q": 2}, cp_comm_type="all_gather")
    assert not r.supported and r.reasons[0].code == "cudnn_table.cp_step_invalid"
    assert r.reasons[0].observed == (0, 0, 8)
    assert r.detail["cp_steps"][0]["error"].startswith("max_seqlen_q=0 is not valid")


@needs_cudnn
def test_cp_step_with_no_tokens_is_not_built():
    # the worker builds no graph for a step that is no valid config (undecided): the table's
    # refusal stands, marked predicted
    r = GRAPH.probe(cfg(**{**CP, "max_seqlen_q": 2}, cp_comm_type="all_gather"), profile("h100"))
    assert not r.supported and r.detail["predicted"] and r.stage == "rule"
    assert r.reasons[0].code == "cudnn_table.cp_step_invalid"
