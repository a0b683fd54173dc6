"""The Triton kernel's GPU branch, run on CPU up to the launch (issue 10, deliverable 2 and
defect 8).

``gpu_launches`` (tests/kernels/conftest.py) presents an H100 (``fake_gpu``) and replaces each JIT
kernel by a launch double that records the launch and runs the same kernel in the interpreter
with the GPU's tile: tuning, ``torch.cuda.device``, ``_split_gqa``'s SM count and the compiled
launch all run, and outputs and gradients are compared with the reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from launch_double import GRID_LIMITS, LaunchDouble, LaunchLog  # noqa: E402
from test_triton_flash import BF16, F16, F32, check, make_case  # noqa: E402

from te_fl_attention.kernels import triton_flash as tf  # noqa: E402
from te_fl_attention.kernels import tuning  # noqa: E402

pytestmark = pytest.mark.skipif(
    not tf.interpreting(), reason="these CPU tests need TRITON_INTERPRET=1 at triton import"
)


def _configs_used(log: LaunchLog, kernel: str) -> set[tuple]:
    return {x.config for x in log.of(kernel)}


@pytest.mark.parametrize(
    "dtype,fmt,h,hkv,mask",
    [
        (BF16, "bshd", 2, 2, "causal"),
        (F16, "thd", 4, 1, "padding_causal_bottom_right"),  # MQA: few programs -> split dK/dV
        (F32, "sbhd", 2, 1, "no_mask"),  # fp32: one config, nothing to tune
    ],
)
def test_gpu_branch_matches_reference_with_tuned_tiles(gpu_launches, dtype, fmt, h, hkv, mask):
    lens = {"lens_q": [9, 20], "lens_kv": [17, 6]} if fmt == "thd" else {}
    q, k, v, do, kw = make_case(dtype=dtype, fmt=fmt, b=2, sq=20, skv=17, h=h, hkv=hkv, dqk=16,
                                **lens)  # fmt: skip
    check(q, k, v, do, attn_mask_type=mask, **kw)
    log = gpu_launches
    gpu = log.gpu
    assert gpu.devices_entered, "launches did not enter the tensors' device"
    for kernel in ("fwd", "dq", "dkdv"):
        used = _configs_used(log, kernel)
        kept = {(c.block_m, c.block_n, c.num_warps, c.num_stages)
                for c in tf.configs(kernel, dtype, q.shape[-1], v.shape[-1])}  # fmt: skip
        assert used and used <= kept, (kernel, used, kept)
        if len(kept) > 1:  # every kept tile was timed once, then the fastest launched
            assert used == kept
    assert log.of("delta") and all(x.meta["num_warps"] == 4 for x in log.of("delta"))
    t = tuning.tuner()
    assert t.tunings == (3 if dtype != F32 else 0)
    assert t.benchmarks == sum(len(tf.configs(n, dtype, 16, 16)) for n in ("fwd", "dq", "dkdv")
                               if len(tf.configs(n, dtype, 16, 16)) > 1)  # fmt: skip
    if hkv < h:  # MQA, 2 sequences: too few programs for 132 SMs -> one program per q head
        dkdv = log.of("dkdv")[-1]
        assert dkdv.grid[0] == -(-17 // dkdv.meta["BLOCK_N"]) * 2 * h


def test_gpu_branch_reuses_the_tuned_tile_in_process(gpu_launches):
    tuning.tuner().warmup = 1  # the timing loop's warm-up launches too
    q, k, v, do, kw = make_case(dtype=BF16, b=1, sq=16, skv=16, h=1, dqk=16)
    check(q, k, v, do, attn_mask_type="causal", **kw)
    n = tuning.tuner().benchmarks
    gpu_launches.launches.clear()
    check(q, k, v, do, attn_mask_type="causal", **kw)
    assert tuning.tuner().benchmarks == n
    assert all(len(_configs_used(gpu_launches, kn)) == 1 for kn in ("fwd", "dq", "dkdv"))


def test_tuner_skips_tiles_the_device_cannot_take(gpu_launches):
    from triton.runtime.errors import OutOfResources

    def refuse(launch):
        if launch.meta.get("BLOCK_M", 0) * launch.meta.get("BLOCK_N", 0) > 32 * 32:
            return OutOfResources(300000, 232448, "shared memory")
        return None

    gpu_launches.refuse = refuse
    q, k, v, do, kw = make_case(dtype=BF16, b=1, sq=16, skv=16, h=1, dqk=16)
    check(q, k, v, do, attn_mask_type="no_mask", **kw)
    for kernel in ("fwd", "dq", "dkdv"):
        assert gpu_launches.of(kernel)[-1].config[:2] == (32, 32)
    gpu_launches.refuse = lambda launch: OutOfResources(1, 0, "shared memory")
    with pytest.raises(OutOfResources):
        tf.flash_attention(q, k, v, attn_mask_type="causal")


def test_no_tuning_while_a_cuda_graph_is_captured(gpu_launches):
    gpu_launches.gpu.capturing = True
    syncs = gpu_launches.gpu.synchronize_calls
    q, k, v, do, kw = make_case(dtype=BF16, b=1, sq=16, skv=16, h=1, dqk=16)
    out = tf.flash_attention(q, k, v, attn_mask_type="causal")
    assert tuning.tuner().benchmarks == 0 and gpu_launches.gpu.synchronize_calls == syncs
    smallest = tf.configs("fwd", BF16, 16, 16)[-1]
    assert gpu_launches.of("fwd")[-1].config == (smallest.block_m, smallest.block_n,
                                                  smallest.num_warps, smallest.num_stages)
    gpu_launches.gpu.capturing = False  # captured once, tuned at the next ordinary launch
    again = tf.flash_attention(q, k, v, attn_mask_type="causal")
    torch.testing.assert_close(again.float(), out.float(), atol=2e-2, rtol=0)
    assert tuning.tuner().tunings == 1


# ------------------------------------------------------------------------ defect 8: grid limits
def _many_heads_case() -> tuple:
    """thd, 2,048 packed sequences x 32 heads: batch * heads = 65,536 (> 65,535)."""
    b, h, d = 2048, 32, 16
    cu = torch.arange(b + 1, dtype=torch.int32)
    q = torch.zeros(b, h, d, dtype=torch.bfloat16, requires_grad=True)
    kw = {"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": 1,
          "max_seqlen_kv": 1, "attn_mask_type": "padding_causal"}  # fmt: skip
    return q, kw, b * h


def _check_grids(log: LaunchLog, batch_heads: int) -> None:
    assert {x.kernel for x in log.launches} >= {"fwd", "delta", "dq", "dkdv"}
    for x in log.launches:
        assert all(n <= lim for n, lim in zip(x.grid, GRID_LIMITS, strict=True)), x.grid
        assert x.grid[0] * x.grid[1] * x.grid[2] >= batch_heads  # every (b, h) has a program


JIT_KERNELS = {"fwd": "_fwd_kernel", "delta": "_bwd_delta_kernel", "dq": "_bwd_dq_kernel",
               "dkdv": "_bwd_dkdv_kernel"}  # fmt: skip


def test_interpreter_grid_fits_cuda_limits_for_65536_batch_heads(monkeypatch):
    log = LaunchLog(execute=False)
    for name, attr in JIT_KERNELS.items():
        monkeypatch.setattr(tf, attr, LaunchDouble(name, getattr(tf, attr), log))
    q, kw, bh = _many_heads_case()
    out = tf.flash_attention(q, q, q, **kw)
    out.sum().backward()
    _check_grids(log, bh)


def test_gpu_grid_fits_cuda_limits_for_65536_batch_heads(gpu_launches):
    gpu_launches.execute = False
    q, kw, bh = _many_heads_case()
    out = tf.flash_attention(q, q, q, **kw)
    out.sum().backward()
    _check_grids(gpu_launches, bh)


def test_too_many_programs_is_a_clear_error():
    with pytest.raises(ValueError, match="grid limit"):
        tf._grid(2**20, 2**20, 16)
