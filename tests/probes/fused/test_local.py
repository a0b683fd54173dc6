"""The cuDNN probe on a local GPU, run on CPU through the hardware seam (``tests/fakegpu``).

What a GPU machine does and what stands in for it here:

* the parent sees an H100 / a B200 through ``fake_gpu`` (device queries, ``cuda.bindings``), so the
  probe captures the local device's descriptor and sends it, with ``use_real_gpu``, to the worker
  of the current device, narrowed to it by ``CUDA_VISIBLE_DEVICES``; that worker loads the stub
  driver (no real one here) and plans deviceless with the captured descriptor;
* "in-process" real-handle planning runs in a child process that reports a real driver and has
  ``fake_cudnn_handle`` installed (``cudnn.create_handle`` and the ``backend_graph(handle=...)``
  that consumes it): cuDNN then plans for real, deviceless, behind the handle. It runs in a child
  because deviceless planning needs the stub ``libcuda.so.1`` loaded into the planning process,
  and the stub must never be loaded into the test process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakegpu import FakeGPU, descriptor

from te_fl_attention import descriptors
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.descriptors import DescriptorError, capture_local_descriptor
from te_fl_attention.device import local, profile
from te_fl_attention.presets import preset
from te_fl_attention.probes.fused import graph as fused_graph
from te_fl_attention.probes.fused import worker as cudnn_worker
from te_fl_attention.probes.fused.probe import CudnnProbe

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cudnn") is None, reason="needs the [cudnn] extra (CI installs it)"
)
ROOT = Path(__file__).resolve().parents[3]
PROBE = CudnnProbe(graph=True)
LLAMA = FusedAttnConfig(**preset("llama3-8b", seqlen=1024))


@pytest.fixture
def fresh_workers(monkeypatch):
    """A worker registry of this test's own (so a worker's spawn environment is this test's)."""
    from te_fl_attention.workers import WorkerPool

    pool = WorkerPool(lambda device: cudnn_worker.CudnnWorker(device=device))
    monkeypatch.setattr(cudnn_worker, "_POOL", pool)
    yield pool
    pool.close_all()


def values(desc):
    """A descriptor's cuDNN fields (our ``_`` metadata dropped)."""
    return {k: v for k, v in desc.items() if not k.startswith("_")}


# ------------------------------------------------------------------ defect 1: the local GPU
@pytest.mark.parametrize("fake_gpu, name", [("h100", "h100"), ("b200", "b200")],
                         indirect=["fake_gpu"])  # fmt: skip
def test_local_gpu_plans_with_the_captured_descriptor(fake_gpu, fresh_workers, name):
    """Defect 1: the probe sent ``None`` for a local GPU and the worker client crashed
    (``'NoneType' object has no attribute 'items'``). Now it captures the local device's
    descriptor and the answer equals the catalog twin's."""
    dev = local()
    assert dev.source == "local" and dev.sm == fake_gpu.sm
    r = PROBE.probe(LLAMA, dev)
    twin = PROBE.probe(LLAMA, profile(name))
    assert r.stage == "graph_build" and r.supported == twin.supported is True
    assert r.detail["plans"] == twin.detail["plans"] and r.detail["plans"]["bwd"]
    assert r.detail["descriptor"] == "captured from device 0 with cuda-bindings"
    # no real driver in the worker (the stub): deviceless with the captured descriptor, said so
    assert r.detail["mode"] == "deviceless" and "deviceless" in r.evidence
    assert any("sees no GPU (stub driver loaded)" in n and fake_gpu.desc["deviceName"] in n
               for n in r.detail["graph_notes"])  # fmt: skip
    refused = PROBE.probe(FusedAttnConfig(head_dim_qk=63, num_heads=8), dev)
    assert not refused.supported and refused.reasons[0].code == "cudnn.not_supported"


def test_default_selector_decides_for_the_local_gpu(fake_gpu, fresh_workers):
    """Defect 1 through the selector (``default_selector()``, the TE plugin's path)."""
    from te_fl_attention.policy import Policy
    from te_fl_attention.probes import default_probes
    from te_fl_attention.selector import Selector

    d = Selector(default_probes(graph=True)).decide(LLAMA, "local", Policy())
    fused = d.result("fused")
    assert d.chosen == "fused" and fused.stage == "graph_build" and fused.detail["plans"]["fwd"]


def test_worker_never_raises_on_a_missing_or_bad_descriptor(fresh_workers):
    """Defect 1: ``worker.probe(cfg, None)`` raised AttributeError in the caller. A missing or
    malformed descriptor is a clear ``cudnn.bad_descriptor`` result."""
    w = cudnn_worker.CudnnWorker()
    try:
        cfg = FusedAttnConfig().to_dict()
        for desc in (None, 42, ["not", "a", "descriptor"]):
            r = w.probe(cfg, desc)
            assert (r["code"], r["step"], r["decided"]) == ("cudnn.bad_descriptor", "device",
                                                            False), (desc, r)  # fmt: skip
        r = w.probe(cfg, None, use_real_gpu=True)  # the worker has the stub, no real GPU
        assert r["code"] == "cudnn.bad_descriptor" and "no real GPU driver" in r["message"]
        assert any("stub driver loaded" in n for n in r["notes"])
        assert w.probe(cfg, "h100")["supported"]  # and it keeps serving
    finally:
        w.close()


def test_probe_never_raises_for_a_device_problem(fake_gpu, fresh_workers, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("the worker pipe broke")

    monkeypatch.setattr(cudnn_worker.CudnnWorker, "probe", broken)
    r = PROBE.probe(LLAMA, local())
    assert r.stage == "rule" and r.detail["predicted"]  # the table's prediction stands
    assert "the worker pipe broke" in r.detail["graph_note"]


# ------------------------------------------------------------------ defect 2: no descriptor
def test_resolve_device_accepts_no_descriptor():
    """Defect 2: ``_resolve_device(None)`` raised TypeError (reported as bad_descriptor)."""
    assert fused_graph._resolve_device(None) is None
    with pytest.raises(DescriptorError):
        fused_graph._resolve_device(42)
    r = fused_graph.probe_config(FusedAttnConfig(), None)  # deviceless, nothing to plan with
    assert r["code"] == "cudnn.bad_descriptor" and "no device descriptor" in r["message"]


# ------------------------------------------------------------------ defect 3: the raw handle
def test_backend_handle_is_the_raw_int():
    """Defect 3: ``backend_graph(handle=...)`` takes the raw ``cudnnHandle_t``; 1.32's
    ``create_handle()`` returns a ``cudnn.Handle``."""
    import cudnn

    assert fused_graph.backend_handle(cudnn.Handle(0x1234, 0, 0)) == 0x1234
    assert fused_graph.backend_handle(None) is None


# ------------------------------------------------------------------ in-process, real handle
CHILD = r"""
import json, sys
import pytest
import fakegpu
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.descriptors import capture_local_descriptor
from te_fl_attention.probes.fused import graph as fused_graph

gpu = sys.modules["te_fl_fake_gpu_installed"].gpu
mp = pytest.MonkeyPatch()
calls = fakegpu.fake_cudnn_handle(mp, gpu)
st = fused_graph.backend_status()
assert st["ok"] and st["driver"] == "stub", st  # cuDNN needs a libcuda: the stub, here
st["driver"] = "real"  # what the backend reports on a machine with a GPU driver
job = json.loads(sys.argv[1])
captured = capture_local_descriptor()
out = {"captured": captured, "rows": []}
for kw in job["configs"]:
    cfg = FusedAttnConfig(**kw).to_dict()
    out["rows"].append({
        "real": fused_graph.probe_config(cfg, captured, use_real_gpu=True),
        "bare": fused_graph.probe_config(cfg, None, use_real_gpu=True),
        "deviceless": fused_graph.probe_config(cfg, job["catalog"]),
    })
out["calls"] = calls
def refuse():
    raise RuntimeError("cudnnCreate failed: CUDNN_STATUS_NOT_INITIALIZED")
mp.setattr(sys.modules["cudnn"], "create_handle", refuse)
getattr(fused_graph, "_handles", {}).clear()
cfg = FusedAttnConfig().to_dict()
out["handle_failed"] = fused_graph.probe_config(cfg, captured, use_real_gpu=True)
out["handle_failed_bare"] = fused_graph.probe_config(cfg, None, use_real_gpu=True)
print("RESULT " + json.dumps(out))
"""

SEAM_CONFIGS = [
    dict(preset("llama3-8b", seqlen=1024)),  # llama-like: causal bf16 GQA sbhd
    dict(head_dim_qk=192, head_dim_v=128, attn_mask_type="causal", num_heads=16),  # MLA
    dict(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal", batch_size=2,
         max_seqlen_q=512),  # fmt: skip
    dict(head_dim_qk=63, num_heads=8),  # refused by cuDNN (hidden_dim % 8)
    dict(head_dim_qk=128, dropout=0.1, bias_type="post_scale_bias", bias_shape="1hss"),
]


def run_child(gpu: str, code: str, *args: str, timeout: int = 300) -> dict:
    env = FakeGPU(gpu).child_env()
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


_SEAM: dict[str, dict] = {}


@pytest.fixture
def seam(request):
    gpu = request.param
    if gpu not in _SEAM:
        _SEAM[gpu] = run_child(gpu, CHILD, json.dumps({"configs": SEAM_CONFIGS, "catalog": gpu}))
    return gpu, _SEAM[gpu]


@pytest.mark.parametrize("seam", ["h100", "b200"], indirect=True)
def test_real_handle_path_plans_and_matches_deviceless(seam):
    """Defects 2 and 3 in-process: with a real driver reported and a (fake) handle, cuDNN plans
    through the handle (mode ``device``); its verdicts and plans equal the deviceless ones for
    the catalog descriptor, also without any descriptor (sm read from the device)."""
    gpu, out = seam
    sm = {"h100": 90, "b200": 100}[gpu]
    assert values(out["captured"]) == values(descriptor(gpu))
    supported = []
    for kw, row in zip(SEAM_CONFIGS, out["rows"], strict=True):
        dl = row["deviceless"]
        assert dl["decided"] and dl["mode"] == "deviceless", (kw, dl)
        for which in ("real", "bare"):
            r = row[which]
            assert r["decided"] and r["mode"] == "device", (kw, which, r)
            assert (r["supported"], r["graph"], r["step"]) == (dl["supported"], dl["graph"],
                                                               dl["step"]), (kw, which)  # fmt: skip
            assert r["plans"] == dl["plans"] and r["sm"] == sm
            assert r["device"] == descriptor(gpu)["deviceName"]
        supported.append(dl["supported"])
    assert supported[:4] == [True, True, True, False]
    # one handle per device, created once, handed to backend_graph as the raw int
    assert out["calls"]["create_handle"] == 1 and out["calls"]["ordinals"] == [0]
    handles = set(out["calls"]["graphs"])
    assert handles == {None, 0xFA4E}


@pytest.mark.parametrize("seam", ["h100"], indirect=True)
def test_failed_handle_falls_back_to_the_descriptor(seam):
    _, out = seam
    r = out["handle_failed"]
    assert r["supported"] and r["mode"] == "deviceless"
    assert any("real cuDNN handle on the local GPU failed" in n for n in r["notes"])
    r = out["handle_failed_bare"]
    assert (r["code"], r["step"], r["decided"]) == ("cudnn.probe_error", "device", False)
    assert "CUDNN_STATUS_NOT_INITIALIZED" in r["message"]


# ------------------------------------------------------------------ defect 4: worker per device
@pytest.mark.parametrize("parent, expected", [
    (None, "3"),
    ("4,5,6,7,0,1,2,3", "7"),
    ("0,1,2,GPU-5c1fe4a2-8d2e-4f5e-9c3a-1b2c3d4e5f60,4,5,6,7",
     "GPU-5c1fe4a2-8d2e-4f5e-9c3a-1b2c3d4e5f60"),
    ("MIG-a,MIG-b,MIG-c,MIG-GPU-5c1fe4a2/1/0,x,y,z,w", "MIG-GPU-5c1fe4a2/1/0"),
])  # fmt: skip
@pytest.mark.parametrize("fake_gpu", ["h100:ordinal=3,count=8"], indirect=True)
def test_worker_is_narrowed_to_the_parents_device(fake_gpu, fresh_workers, monkeypatch,
                                                  parent, expected):  # fmt: skip
    """Defect 4: the worker created its handle on GPU 0 whatever the parent's device. Now rank
    3 of an 8-GPU node gets a worker of its own that sees only the parent's device 3 (mapped
    through the parent's CUDA_VISIBLE_DEVICES), so its device 0 is the parent's device."""
    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    r = PROBE.probe(LLAMA, local())
    assert r.supported and r.stage == "graph_build"
    assert r.detail["descriptor"] == "captured from device 3 with cuda-bindings"
    workers = fresh_workers._workers
    assert list(workers) == [3]  # no worker for any other device
    hello = workers[3].hello
    assert hello["cuda_visible_devices"] == expected and hello["parent_device"] == "3"


@pytest.mark.parametrize("ordinal, parent, expected", [
    (0, None, "0"), (2, "", "2"), (1, "3, 5", "5"), (2, "3,5", None), (0, "GPU-a", "GPU-a"),
])  # fmt: skip
def test_visible_device_mapping(ordinal, parent, expected):
    assert cudnn_worker.visible_device(ordinal, parent) == expected


def test_unmappable_device_plans_deviceless(fresh_workers):
    """A parent device its CUDA_VISIBLE_DEVICES does not list cannot be named to a child: no
    real handle then (it could be another GPU), the descriptor answers."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    with cudnn_worker.CudnnWorker(env=env, device=2) as w:
        r = w.probe(FusedAttnConfig().to_dict(), "h100", use_real_gpu=True)
        assert r["supported"] and r["mode"] == "deviceless"
        assert "cannot be narrowed" in r["notes"][0]
        assert w.hello["cuda_visible_devices"] == "0"


# ------------------------------------------------------------------ descriptor capture
@pytest.mark.parametrize("fake_gpu", ["h100", "b200"], indirect=True)
def test_capture_with_cuda_bindings_equals_the_catalog(fake_gpu):
    desc = capture_local_descriptor()
    assert values(desc) == values(descriptor(fake_gpu.name))
    assert desc["_captured"] == "cuda-bindings"


@pytest.mark.parametrize("fake_gpu", ["h100", "b200"], indirect=True)
def test_capture_with_torch_equals_the_catalog(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # cuda-bindings unavailable
    desc = capture_local_descriptor()
    assert values(desc) == values(descriptor(fake_gpu.name))
    assert desc["_captured"] == "torch" and "driverVer" not in desc["_estimated"]
    assert {"maxCtasPerSM", "reservedSharedMemoryPerBlock"} <= set(desc["_estimated"])


def test_capture_with_torch_without_a_driver_version(fake_gpu, monkeypatch):
    import torch

    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion")  # a torch without the helper
    desc = descriptors._capture_with_torch(0)
    assert desc["driverVer"] == descriptors.ASSUMED_DRIVER_VERSION
    assert "driverVer" in desc["_estimated"]

    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", broken, raising=False)
    assert "driverVer" in descriptors._capture_with_torch(0)["_estimated"]
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(DescriptorError, match="torch is not installed"):
        descriptors._capture_with_torch(0)


def test_capture_with_an_older_cuda_bindings(fake_gpu, monkeypatch):
    """A cuda-bindings without an optional attribute gets its default; without a required one
    the capture falls back to torch."""
    import types

    drv = sys.modules["cuda.bindings.driver"]
    real = drv.CUdevice_attribute
    names = [n for n in dir(real) if n.startswith("CU_DEVICE_ATTRIBUTE_")]
    older = types.SimpleNamespace(**{n: getattr(real, n) for n in names
                                     if n != "CU_DEVICE_ATTRIBUTE_TCC_DRIVER"})  # fmt: skip
    monkeypatch.setattr(drv, "CUdevice_attribute", older)
    desc = descriptors.capture_device_descriptor(0)
    assert desc["_captured"] == "cuda-bindings" and desc["isTccDriver"] == 0
    delattr(older, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
    desc = descriptors.capture_device_descriptor(0)
    assert desc["_captured"] == "torch" and values(desc) == values(descriptor("h100"))


@pytest.mark.parametrize("fake_gpu", ["h100:ordinal=3,count=8"], indirect=True)
def test_capture_is_cached_per_device(fake_gpu, monkeypatch):
    asked = []
    real = descriptors.capture_device_descriptor
    monkeypatch.setattr(descriptors, "capture_device_descriptor",
                        lambda o: asked.append(o) or real(o))  # fmt: skip
    first = capture_local_descriptor()
    first["deviceName"] = "changed by the caller"
    assert capture_local_descriptor()["cudaDeviceId"] == 3 and asked == [3]
    assert capture_local_descriptor()["deviceName"] == descriptor("h100")["deviceName"]
    capture_local_descriptor(1)
    assert asked == [3, 1]


def test_capture_falls_back_and_reports_both_failures(fake_gpu, monkeypatch):
    drv = sys.modules["cuda.bindings.driver"]
    bad = drv.CUresult.CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(drv, "cuDeviceGet", lambda ordinal: (bad, None))
    desc = capture_local_descriptor()
    assert desc["_captured"] == "torch"  # the driver call failed: torch answered
    descriptors._reset_captured()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DescriptorError, match="cuda-bindings: CUDA driver call failed.*torch"):
        capture_local_descriptor()


def test_descriptor_for_a_local_profile(fake_gpu, monkeypatch):
    assert descriptors.descriptor_for(local())["_captured"] == "cuda-bindings"
    other = local().with_overrides({"sm": "100"})  # a what-if on the local profile
    desc = descriptors.descriptor_for(other)
    assert desc["deviceVer"] == 1000 and "_captured" not in desc
    assert "is not the profile's" in desc["_sources"]["*"]

    def fails(ordinal):
        raise DescriptorError("the driver said no")

    descriptors._reset_captured()
    monkeypatch.setattr(descriptors, "capture_device_descriptor", fails)
    desc = descriptors.descriptor_for(local())  # synthesized, saying why
    assert "_captured" not in desc and desc["deviceVer"] == 900
    assert "capturing the local device failed: the driver said no" in desc["_sources"]["*"]


# ------------------------------------------------------------------ the CLI, in a child process
def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "te_fl_attention.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_explain_local_decides_fused_at_graph_build(gpu):
    """``te-fl-attn explain --device local`` on a (presented) H100 / B200: the fused candidate
    is decided by cuDNN with the descriptor captured from the local device, as for its twin."""
    p = cli("explain", "--device", "local", "--preset", "llama3-8b", "--json",
            env=FakeGPU(gpu).child_env())  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(p.stdout)
    assert data["device"]["source"] == "local" and data["device"]["sm"] == FakeGPU(gpu).sm
    fused = next(r for r in data["results"] if r["backend"] == "fused")
    assert fused["stage"] == "graph_build" and fused["supported"] and data["chosen"] == "fused"
    assert fused["detail"]["descriptor"] == "captured from device 0 with cuda-bindings"
    twin = PROBE.probe(FusedAttnConfig(**preset("llama3-8b")), profile(gpu))
    assert fused["detail"]["plans"] == twin.detail["plans"]
    assert fused["supported"] == twin.supported and twin.stage == "graph_build"


def test_device_capture_cli(tmp_path):
    env = dict(FakeGPU("b200").child_env(), TE_FL_ATTN_DESCRIPTORS=str(tmp_path / "installed"))
    out = tmp_path / "b200.json"
    p = cli("device", "capture", "-o", str(out), "--install", "b200", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert values(json.loads(out.read_text())) == values(descriptor("b200"))
    installed = json.loads((tmp_path / "installed" / "b200.json").read_text())
    assert installed["_captured"] and values(installed) == values(descriptor("b200"))
    bare = {k: v for k, v in os.environ.items() if k != "TE_FL_TEST_FAKE_GPU"}
    p = cli("device", "capture", env=bare)
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr
