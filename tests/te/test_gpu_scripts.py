"""The GPU acceptance run's TE checks (``scripts/gpu/te_decisions.py``, ``te_dpa.py``) on CPU.

Both scripts are meant for a GPU with a real TE build; here they run against TE 2.20.2 booted with
the stub extension (``te_boot``) in a child that sees a GPU through ``tests/fakegpu``. TE's C++
fused query is answered by the stub (our support table); DotProductAttention's ``is_cuda``
assertion is met by making the inputs look like CUDA tensors at ``te_dpa.make_input``, the one
place the script allocates them (the data stays on the CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from fakegpu import FakeGPU

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import te_dpa  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    env = FakeGPU("h100").child_env()
    return {"PYTHONPATH": env["PYTHONPATH"], "TE_FL_TEST_FAKE_GPU": env["TE_FL_TEST_FAKE_GPU"],
            **extra}  # fmt: skip


def test_te_decisions_compares_both_answers_per_config(te_script, tmp_path) -> None:
    report = te_script(f"""
    import te_boot
    te_boot.boot(plugin=None)
    sys.path.insert(0, {str(ROOT / "scripts" / "gpu")!r})
    import te_decisions
    rc = te_decisions.main(["--imported", "--limit", "6", "--out", {str(tmp_path)!r}])
    report(rc=rc)
    """, env=_env(TE_FL_ATTN_CUDNN_PROBE="1"))
    assert report["rc"] == 0
    data = json.loads((tmp_path / "te_decisions.json").read_text())
    assert data["configs"] == 6 and data["gpu"] == "NVIDIA H100 80GB HBM3"
    assert data["agree"] + data["disagree"] == 6
    for row in data["rows"]:
        assert row["te"].split(":")[0] in ("flash", "fused", "unfused", "none", "error")
        assert row["ours"].split(":")[0] in ("flash", "fused", "unfused", "none")
        assert row["agree"] == (row["te"] == row["ours"])
    # the base causal bf16 config on an H100: both pick FusedAttention's F16 sub-backend
    assert data["rows"][1]["te"] == data["rows"][1]["ours"] == "fused:1"


def test_te_dpa_configs_cover_at_least_ten_runnable_families() -> None:
    cases = te_dpa.runnable()
    assert len(cases) >= 10
    assert {"base", "mla", "window", "gqa", "thd", "bias"} <= {f for f, _ in cases}
    for _, cfg in cases:
        s = te_dpa.shapes(cfg)
        assert s["q"][-1] == cfg.head_dim_qk and s["v"][-1] == cfg.head_dim_v


RUN = """
import te_boot
te_boot.boot(plugin={plugin!r})
sys.path.insert(0, {scripts!r})
import torch
import te_dpa
from te_fl_attention.config import FusedAttnConfig

class CudaLooking(torch.Tensor):
    @property
    def is_cuda(self):
        return True

def make_input(shape, dtype, seed, grad=True):  # the device allocation, replaced
    return torch.Tensor._make_subclass(CudaLooking, te_dpa.seeded(shape, dtype, seed, False), grad)

te_dpa.make_input = make_input
cases = [("base", FusedAttnConfig(batch_size=1, max_seqlen_q=16, num_heads=2, head_dim_qk=16,
                                  dtype="fp32", qkv_layout="bshd_bshd_bshd",
                                  attn_mask_type="no_mask")),
         ("gqa", FusedAttnConfig(batch_size=2, max_seqlen_q=16, num_heads=4, num_gqa_groups=2,
                                 head_dim_qk=16, dtype="fp32", qkv_layout="sbhd_sbhd_sbhd",
                                 attn_mask_type="no_mask"))]
rows = te_dpa.run_configs(cases)
for r in rows:
    r["tensors"] = {{k: v.as_subclass(torch.Tensor) for k, v in r.get("tensors", {{}}).items()}}
torch.save(rows, {path!r})
report(backends=[r.get("backend") for r in rows], errors=[r.get("error") for r in rows])
"""


def _reference_rows(cases: list) -> list[dict]:
    """What a native run would record, computed with our reference on the same seeded inputs."""
    from te_fl_attention.kernels import reference

    rows = []
    for i, (family, cfg) in enumerate(cases):
        s = te_dpa.shapes(cfg)
        q, k, v = (te_dpa.make_input.__wrapped__(s[n], torch.float32, 10 * i + j)
                   for j, n in enumerate(("q", "k", "v")))  # fmt: skip
        out = reference.attention(q, k, v, qkv_format=cfg.qkv_format,
                                  attn_mask_type=cfg.attn_mask_type)  # fmt: skip
        out = out.reshape(*out.shape[:-2], -1)
        grad = te_dpa.make_input.__wrapped__(tuple(out.shape), torch.float32, 10 * i + 9, False)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        rows.append({"family": family, "config": cfg.to_dict(), "backend": "reference",
                     "tensors": {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}})
    return rows


def test_te_dpa_runs_te_through_the_plugin_and_compares(te_script, tmp_path) -> None:
    """The plugin side runs TE's real DotProductAttention (our router, our Triton kernel in the
    interpreter); the native side of a GPU run cannot execute on CPU (TE's native kernels need
    CUDA), so it is stood in for by the reference on the same inputs, and :func:`te_dpa.compare`
    is checked on both an agreeing and a disagreeing pair."""
    from te_fl_attention.config import FusedAttnConfig

    scripts = str(ROOT / "scripts" / "gpu")
    plugin = te_script(RUN.format(plugin="te_fl_attention", scripts=scripts,
                                  path=str(tmp_path / "p.pt")),
                       env=_env(TE_FL_ATTN_FORCE="triton", TRITON_INTERPRET="1"))  # fmt: skip
    assert plugin["errors"] == [None, None]
    assert plugin["backends"] == ["FlashAttention"] * 2  # TE's flash slot: our Triton kernel
    cases = [("base", FusedAttnConfig(batch_size=1, max_seqlen_q=16, num_heads=2, head_dim_qk=16,
                                      dtype="fp32", attn_mask_type="no_mask")),
             ("gqa", FusedAttnConfig(batch_size=2, max_seqlen_q=16, num_heads=4,
                                     num_gqa_groups=2, head_dim_qk=16, dtype="fp32",
                                     qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="no_mask"))]
    ran = torch.load(tmp_path / "p.pt", weights_only=False)
    report = te_dpa.compare(ran, _reference_rows(cases))
    assert report["configs"] == 2 and report["same_backend"] == 0
    assert 0 < report["max_err_out"] < 1e-4 and report["max_err_grad"] < 1e-4
    wrong = _reference_rows(cases)
    wrong[1]["tensors"]["dk"] = wrong[1]["tensors"]["dk"] * 2
    assert te_dpa.compare(ran, wrong)["max_err_grad"] > 0.1
