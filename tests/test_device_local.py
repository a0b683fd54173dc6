"""``device.local()`` on a machine with a GPU, run on CPU through the hardware seam (NVML and
torch.cuda answered for an H100 / a B200 by ``tests/fakegpu``)."""

from __future__ import annotations

import sys

import pytest

from te_fl_attention.device import local


@pytest.mark.parametrize("fake_gpu, sm, sms, mem", [("h100", 90, 132, 80.0),
                                                    ("b200", 100, 148, 180.0)],
                         indirect=["fake_gpu"])  # fmt: skip
def test_local_reads_the_current_gpu(fake_gpu, sm, sms, mem):
    d = local()
    assert (d.sm, d.sm_count, d.memory_gib, d.source) == (sm, sms, mem, "local")
    assert d.name == fake_gpu.desc["deviceName"] and d.cudnn == "9.28.1" and d.cuda == "13.0"
    assert d.driver == "580.95.05"  # from NVML


@pytest.mark.parametrize("fake_gpu", ["h100:ordinal=5,count=8"], indirect=True)
def test_local_is_the_current_device_of_a_multi_gpu_node(fake_gpu):
    assert local().sm_count == 132 and local() is local()  # cached for the process


@pytest.mark.parametrize("failure", ["no_devices", "query_raises", "shutdown_raises"])
def test_nvml_trouble_leaves_the_torch_answer(fake_gpu, monkeypatch, failure):
    """NVML without devices, a failing NVML query, a failing shutdown: the driver version is
    then unknown (or kept), never a crash; torch still names the GPU."""
    nvml = sys.modules["pynvml"]
    if failure == "no_devices":
        monkeypatch.setattr(nvml, "nvmlDeviceGetCount", lambda: 0)
    elif failure == "query_raises":
        def boom(*a):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

        monkeypatch.setattr(nvml, "nvmlDeviceGetName", boom)
    else:
        def boom(*a):
            raise RuntimeError("NVML_ERROR_UNINITIALIZED")

        monkeypatch.setattr(nvml, "nvmlShutdown", boom)
    d = local()
    assert d.sm == 90 and d.name == "NVIDIA H100 80GB HBM3"
    assert d.driver == ("580.95.05" if failure == "shutdown_raises" else None)
