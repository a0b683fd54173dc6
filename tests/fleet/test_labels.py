"""Labels (fleet/labels.py): short refusal reasons, real GPUs matched to catalog types."""

from __future__ import annotations

import dataclasses

from fleet_testutil import FP32, LLAMA, real_gpu

from te_fl_attention import Policy
from te_fl_attention.device import CATALOG
from te_fl_attention.fleet import device_type, short_reason


def test_short_reason_prefers_the_installed_flavour(sel):
    d = sel.decide(FP32, "a100", Policy(triton=False))
    want = "qkv_dtype = fp32 is not supported by FlashAttention 2"
    assert short_reason(d.result("flash")) == want
    d = sel.decide(LLAMA, "h100", Policy(flash=False))
    assert short_reason(d.result("flash")).startswith("disabled by NVTE_FLASH_ATTN=0")


def test_device_type_matches_real_gpus_to_the_catalog():
    assert device_type(real_gpu()) == "h100"
    assert device_type(real_gpu("NVIDIA H200", "h200", 139.8)) == "h200"
    assert device_type(dataclasses.replace(real_gpu(), sm_count=114, name="H100 PCIe")) == \
        "H100 PCIe"  # fmt: skip
    assert all(device_type(d) == n for n, d in CATALOG.items())
