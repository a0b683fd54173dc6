"""The TE plugin deciding for the machine's own GPU, run on CPU through the hardware seam.

The child process sees an H100 or a B200 through ``tests/fakegpu`` (only the calls that need the
hardware are replaced: device queries, tensor placement, kernel launches); TE 2.20.2 is booted
with ``NVTE_PLUGIN`` as in the other TE tests, no ``TE_FL_ATTN_DEVICE`` is set, so the plugin
decides for ``local()``. The cuDNN probe plans through cuDNN's real deviceless planner with a
descriptor captured from the (presented) local device.
"""

from __future__ import annotations

import pytest
from fakegpu import FakeGPU

SCENARIO = """
import te_boot
te_boot.boot()
utils, dpa = te_boot.modules()
import torch
from te_fl_attention import explain
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import local
from te_fl_attention.plugin import te as plugin

params = utils.AttentionParams(qkv_dtype=torch.bfloat16, qkv_layout="bshd_bshd_bshd",
                               attn_mask_type="causal", window_size=(-1, 0), num_heads=16,
                               num_gqa_groups=8, head_dim_qk=128, head_dim_v=128,
                               max_seqlen_q=1024, max_seqlen_kv=1024, is_training=True)
tuple_ = utils.get_attention_backend(params)
decision = explain(FusedAttnConfig.from_attention_params(params))
named = explain(FusedAttnConfig.from_attention_params(params), device=os.environ["CATALOG"])
fused = decision.result("fused")
report(ours=utils.get_attention_backend is plugin.get_attention_backend,
       use_flash=tuple_[0], use_fused=tuple_[2], fused_backend=str(tuple_[3]),
       use_unfused=tuple_[4], device=decision.device.name, sm=decision.device.sm,
       source=decision.device.source, chosen=decision.chosen, fused_stage=fused.stage,
       fused_evidence=fused.evidence, fused_mode=fused.detail.get("mode"),
       fused_plans=bool(fused.detail.get("plans", {}).get("bwd")),
       flash_variant=decision.detail.get("flash_variant"),
       verdicts={r.backend: r.supported for r in decision.results},
       named_verdicts={r.backend: r.supported for r in named.results})
"""


@pytest.mark.parametrize("gpu, catalog", [("h100", "h100"), ("b200", "b200")])
def test_plugin_decides_for_the_local_gpu_with_cudnn_graphs(te_script, gpu, catalog) -> None:
    env = FakeGPU(gpu).child_env(flash=True)
    report = te_script(SCENARIO, env={"PYTHONPATH": env["PYTHONPATH"],
                                      "TE_FL_TEST_FAKE_GPU": env["TE_FL_TEST_FAKE_GPU"],
                                      "TE_FL_ATTN_CUDNN_PROBE": "1", "CATALOG": catalog})
    assert report["ours"] and report["source"] == "local"
    assert report["sm"] == {"h100": 90, "b200": 100}[gpu]
    # sm >= 90: FusedAttention first, decided by cuDNN itself (not the support-table rules)
    assert report["chosen"] == "fused" and report["use_fused"] and not report["use_flash"]
    assert report["fused_stage"] == "graph_build" and report["fused_plans"]
    assert "graph" in report["fused_evidence"]
    # the local GPU answers as its catalog twin does (same descriptor values, same stack); our
    # Triton candidate is left out: locally it compiles and launches a tiny run, the one call
    # this child does not replace (a catalog answer is the rules' prediction)
    local = {k: v for k, v in report["verdicts"].items() if k != "triton"}
    assert local == {k: v for k, v in report["named_verdicts"].items() if k != "triton"}
