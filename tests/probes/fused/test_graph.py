"""cuDNN decides the fused candidate: deviceless SDPA graph probes, the stub driver, the worker.

The expected answers below were discovered by running cuDNN 9.28.1 (cudnn-frontend 1.32.0) in
deviceless mode with the catalog descriptors, then written down; the asserted substrings are
cuDNN's own words. They describe what cuDNN's heuristics say for a *described* device; no GPU
confirmed them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
from cudnn_skip import require_cudnn

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.descriptors import (
    CATALOG_NAMES,
    CC_LIMITS,
    REQUIRED_FIELDS,
    DescriptorError,
    cudnn_json,
    descriptor_for,
    descriptor_sm,
    load_descriptor,
    synthesize_descriptor,
)
from te_fl_attention.device import CATALOG, DeviceProfile, profile
from te_fl_attention.probes.fused import stubcuda
from te_fl_attention.probes.fused.graph import summarize
from te_fl_attention.probes.fused.mapping import layout_pieces, strides_bhsd
from te_fl_attention.probes.fused.worker import CudnnWorker

require_cudnn()

B = dict(batch_size=2, num_heads=16, max_seqlen_q=512, dtype="bf16")
PLAN_NAME = re.compile(r"^eng\d+(_k\d+=-?\d+)*$")


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stubcuda")


@pytest.fixture(scope="module")
def worker(stub_dir):
    env = dict(os.environ, TE_FL_ATTENTION_STUB_DIR=str(stub_dir))
    w = CudnnWorker(env=env)
    yield w
    w.close()


def probe(worker, device="h100", **fields):
    r = worker.probe(FusedAttnConfig(**{**B, **fields}).to_dict(), device)
    json.dumps(r)  # always plain JSON
    return r


def assert_supported(r, graphs=("fwd", "bwd")):
    assert r["supported"] and r["decided"], r
    assert r["code"] is None and r["step"] is None
    assert r["cudnn_version"].startswith("9.") and r["mode"] == "deviceless"
    assert sorted(r["plans"]) == sorted(graphs)
    for names in r["plans"].values():
        assert names and all(PLAN_NAME.match(n) for n in names), names


def assert_refused(r, step, graph, text):
    assert not r["supported"] and r["decided"], r
    assert r["code"] == "cudnn.not_supported"
    assert (r["step"], r["graph"]) == (step, graph)
    assert text in r["message"] and text in r["summary"]


# ------------------------------------------------------------------------------ cuDNN's answers
@pytest.mark.parametrize("mask", ["causal", "no_mask", "padding"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_bf16_supported_with_plans(worker, head_dim, mask):
    r = probe(worker, head_dim_qk=head_dim, attn_mask_type=mask)
    assert_supported(r)
    assert r["sm"] == 90 and r["device"] == "NVIDIA H100 80GB HBM3"
    assert r["heur_mode"] == {"fwd": "A", "bwd": "A"}


def test_head_dim_not_multiple_of_8_refused(worker):
    assert_refused(
        probe(worker, head_dim_qk=63), "validate", "fwd", "hidden_dim should be multiple of 8"
    )


def test_turing_refused(worker):
    r = probe(worker, "t4", attn_mask_type="causal")
    assert r["sm"] == 75
    assert_refused(
        r, "validate", "fwd", "SDPA FP16/BF16 requires SM80 (Ampere) or newer architecture"
    )


def test_fp32_refused_by_te_before_any_graph(worker):
    # cuDNN has an fp32 forward engine, but TE 2.20.2's nvte_get_fused_attn_backend_v2 refuses
    # any qkv dtype other than FP16/BF16/FP8 before building a graph (its Python rules refuse
    # fp32 anyway), so the probe asks cuDNN nothing.
    for training in (True, False):
        r = probe(worker, dtype="fp32", is_training=training)
        assert (r["supported"], r["decided"], r["code"], r["step"]) == (
            False, True, "cudnn.te_refused", "derive")  # fmt: skip
        assert "Unsupported QKV dtype" in r["message"] and r["plans"] == {}


def test_head_dim_limits_by_arch(worker):
    r = probe(worker, "a100", head_dim_qk=256, attn_mask_type="causal")
    assert r["plans"]["fwd"]  # the forward is fine; the backward is not
    assert_refused(r, "validate", "bwd", "hidden_dim should be less than or equal to 128")
    assert_refused(
        probe(worker, head_dim_qk=264),
        "validate",
        "bwd",
        "hidden_dim should be less than or equal to 256",
    )
    assert_supported(probe(worker, head_dim_qk=512, is_training=False), graphs=("fwd",))


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_gqa_groups=4, attn_mask_type="causal"),  # GQA
        dict(num_gqa_groups=1),  # MQA
        dict(head_dim_qk=192, head_dim_v=128, attn_mask_type="causal"),  # MLA
        dict(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal"),
        dict(qkv_layout="sb3hd", attn_mask_type="causal"),
        dict(qkv_layout="bshd_bs2hd", num_gqa_groups=4),
        dict(max_seqlen_q=128, max_seqlen_kv=512, attn_mask_type="causal_bottom_right"),
        dict(attn_mask_type="causal", window_size=(128, 0), dropout=0.1),  # SWA + dropout
        dict(window_size=(64, 64)),
        dict(bias_type="post_scale_bias", bias_shape="bhss", bias_requires_grad=True),
        dict(bias_type="alibi", attn_mask_type="causal"),
        dict(softmax_type="off-by-one", attn_mask_type="causal"),
        dict(deterministic=True),
        dict(return_max_logit=True),
    ],
    ids=[
        "gqa",
        "mqa",
        "mla",
        "thd",
        "sb3hd",
        "bshd_bs2hd",
        "br_causal_sq<skv",
        "swa_dropout",
        "swa_both_sides",
        "bias_bhss_grad",
        "alibi",
        "off_by_one",
        "deterministic",
        "max_logit",
    ],
)
def test_sm90_features_supported(worker, fields):
    assert_supported(probe(worker, **fields))


def test_bottom_right_causal_longer_q_refused(worker):
    assert_refused(
        probe(worker, max_seqlen_kv=256, attn_mask_type="causal_bottom_right"),
        "validate",
        "fwd",
        "Bottom right causal mask does not support max_s_q > max_s_kv",
    )


def test_inference_builds_forward_only(worker):
    r = probe(
        worker,
        qkv_layout="paged_kv_bshd_bshd_bshd",
        attn_mask_type="padding",
        page_size=64,
        is_training=False,
    )
    assert_supported(r, graphs=("fwd",))


def test_thd_without_padding_mask_refused_by_te(worker):
    # TE 2.20.2 refuses THD without a padding mask before building a graph (it used to be
    # implied here, with a note).
    r = probe(worker, qkv_layout="thd_thd_thd")
    assert (r["supported"], r["decided"], r["code"], r["step"]) == (
        False, True, "cudnn.te_refused", "derive")  # fmt: skip
    assert "fused_cpp.thd_mask: thd needs a padding mask type" in r["message"]


def test_alibi_slopes_built_as_te_post_scale_bias(worker):
    # TE's Python turns ALiBi with custom slopes into a post-scale bias [1, h, s_q, s_kv]
    # (with dBias in the backward); this used to be refused undecided.
    r = worker.probe(FusedAttnConfig(**{**B, "bias_type": "alibi", "alibi_slopes_shape": (16,)}
                                     ).to_dict(), "h100", spec=True)  # fmt: skip
    assert_supported(r)
    fwd, bwd = r["graph_spec"]["fwd"], r["graph_spec"]["bwd"]
    bias = {t["name"]: t for t in fwd["tensors"]}["bias"]
    assert bias["dim"] == [1, 16, 512, 512] and not fwd["nodes"][0]["alibi_mask"]
    assert "dBias" in bwd["nodes"][0]["outputs"]


def test_fp8(worker):
    r = probe(worker, dtype="fp8_e4m3", fp8=True, head_dim_qk=128, attn_mask_type="causal")
    assert_supported(r)
    r = probe(worker, fp8=True, fp8_recipe="mxfp8")
    assert (r["supported"], r["decided"], r["code"], r["step"]) == (
        False,
        False,
        "cudnn.fp8_unsupported_by_probe",
        "mapping",
    )


def test_pre_scale_bias_refused_by_te(worker):
    r = probe(worker, bias_type="pre_scale_bias")
    assert (r["supported"], r["decided"], r["code"]) == (False, True, "cudnn.te_refused")
    assert "fused_cpp.pre_scale_bias: pre_scale_bias is not supported" in r["message"]


@pytest.mark.parametrize(
    "fields",
    [dict(softcap=30.0), dict(attn_mask_type="arbitrary")],
    ids=["softcap", "arbitrary_mask"],
)
def test_unsupported_by_probe_is_undecided(worker, fields):
    r = probe(worker, **fields)
    assert (r["supported"], r["decided"], r["code"], r["step"]) == (
        False,
        False,
        "cudnn.unsupported_by_probe",
        "mapping",
    )
    assert r["message"]


@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_cudnn_accepts_every_descriptor(worker, name):
    r = probe(worker, name, head_dim_qk=128, attn_mask_type="causal")
    assert r["decided"], r  # the descriptor was accepted and cuDNN answered
    assert r["sm"] == CATALOG[name].sm
    assert r["supported"] == (name != "t4")


def test_bad_descriptor(worker):
    desc = load_descriptor("h100")
    del desc["l2CacheSize"]
    r = worker.probe(FusedAttnConfig().to_dict(), desc)
    assert (r["code"], r["step"], r["decided"]) == ("cudnn.bad_descriptor", "device", False)
    assert "l2CacheSize" in r["message"]
    r = worker.probe(FusedAttnConfig().to_dict(), "no-such-gpu")
    assert r["code"] == "cudnn.bad_descriptor"


# ------------------------------------------------------------------------------ crash isolation
def test_worker_killed_between_probes(worker):
    assert probe(worker)["supported"]
    old = worker.pid
    os.kill(old, signal.SIGKILL)
    time.sleep(0.1)
    r = probe(worker)
    assert r["supported"] and worker.pid not in (None, old)
    assert any("had died (signal 9, SIGKILL) while idle" in n for n in r["notes"])


def test_worker_killed_mid_probe(worker):
    assert probe(worker)["supported"]
    pid = worker.pid
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    r = worker.request({"op": "sleep", "seconds": 20}, timeout_s=30)
    assert (r["supported"], r["decided"], r["step"], r["code"]) == (
        False,
        False,
        "worker",
        "cudnn.worker_died",
    )
    assert f"probe worker (pid {pid}) died (signal 9, SIGKILL)" in r["message"]
    r = probe(worker, head_dim_qk=128)
    assert r["supported"] and r["notes"] == []


def test_worker_timeout_kills_and_recovers(worker):
    starts = worker.starts
    r = worker.request({"op": "sleep", "seconds": 20}, timeout_s=0.5)
    assert (r["step"], r["code"]) == ("worker", "cudnn.worker_timeout")
    assert "timed out after 0.5 s" in r["message"]
    assert probe(worker)["supported"] and worker.starts == starts + 1


def test_worker_without_compiler_reports_unavailable(tmp_path):
    env = dict(
        os.environ, TE_FL_ATTENTION_STUB_DIR=str(tmp_path), CC="/nonexistent/cc", PATH=str(tmp_path)
    )
    with CudnnWorker(env=env) as w:
        r = w.probe(FusedAttnConfig().to_dict(), "h100")
    assert (r["supported"], r["decided"], r["code"], r["step"]) == (
        False,
        False,
        "cudnn.unavailable",
        "backend",
    )
    assert "no C compiler found" in r["message"]
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ stub safety
@pytest.fixture
def fresh_stub_state(monkeypatch, tmp_path):
    monkeypatch.setenv("TE_FL_ATTENTION_STUB_DIR", str(tmp_path))
    saved = stubcuda.current_setup()
    stubcuda._reset_for_tests()
    calls = []
    monkeypatch.setattr(stubcuda, "build_stub", lambda: calls.append("build") or tmp_path / "x")
    monkeypatch.setattr(stubcuda, "load_stub", lambda path: calls.append("load"))
    yield calls
    stubcuda._reset_for_tests()
    stubcuda._state = saved


@pytest.mark.parametrize("devices", [1, 0])
def test_stub_never_built_or_loaded_when_real_driver_loadable(
    fresh_stub_state, monkeypatch, devices
):
    monkeypatch.setattr(
        stubcuda,
        "real_driver_status",
        lambda: stubcuda.DriverStatus(True, devices, "test double"),
    )
    setup = stubcuda.setup_driver()
    assert setup.mode == ("real" if devices else "real-nodevice")
    assert fresh_stub_state == []


def test_stub_built_and_loaded_without_driver(fresh_stub_state, monkeypatch):
    monkeypatch.setattr(
        stubcuda, "real_driver_status", lambda: stubcuda.DriverStatus(False, 0, "test double")
    )
    assert stubcuda.setup_driver().mode == "stub"
    assert fresh_stub_state == ["build", "load"]


def test_no_compiler_means_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("TE_FL_ATTENTION_STUB_DIR", str(tmp_path))
    monkeypatch.setattr(stubcuda, "find_compiler", lambda: None)
    monkeypatch.setattr(
        stubcuda, "real_driver_status", lambda: stubcuda.DriverStatus(False, 0, "test double")
    )
    saved = stubcuda.current_setup()
    stubcuda._reset_for_tests()
    try:
        setup = stubcuda.setup_driver()
    finally:
        stubcuda._reset_for_tests()
        stubcuda._state = saved
    assert setup.mode == "unavailable" and "no C compiler found" in setup.error
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not stubcuda.find_compiler(), reason="no C compiler")
def test_stub_build_is_cached_by_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("TE_FL_ATTENTION_STUB_DIR", str(tmp_path))
    path = stubcuda.build_stub()  # built, not loaded: this test process keeps no stub
    assert path == stubcuda.stub_path() and path.name == "libcuda.so.1"
    assert path.parent.parent == tmp_path and len(path.parent.name) == 16
    mtime = path.stat().st_mtime_ns
    assert stubcuda.build_stub() == path and path.stat().st_mtime_ns == mtime
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-dW", str(path)], capture_output=True, text=True).stdout
        assert "Library soname: [libcuda.so.1]" in dyn
    if shutil.which("nm"):
        syms = subprocess.run(
            ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True
        ).stdout
        for name in (
            "cuInit",
            "cuDriverGetVersion",
            "cuDeviceGetCount",
            "cuGetProcAddress_v2",
            "cuModuleLoadData",
            "cuTensorMapEncodeTiled",
            "cuLibraryLoadData",
        ):
            assert f" T {name}\n" in syms, name


@pytest.mark.skipif(not stubcuda.find_compiler(), reason="no C compiler")
def test_incomplete_stub_is_flagged_not_believed(tmp_path, monkeypatch):
    # A stub lacking a symbol cuDNN resolves at plan time makes cuDNN decline every engine; the
    # worker notices cuDNN's "Could not load symbol" and marks the answer undecided.
    monkeypatch.setenv("TE_FL_ATTENTION_STUB_DIR", str(tmp_path))
    target = stubcuda.stub_path()
    target.parent.mkdir(parents=True)
    src = (
        stubcuda.stub_source()
        .decode()
        .replace("STUB_EXPORT stub_result cuLaunchKernel(", "static stub_result not_exported(")
    )
    (tmp_path / "broken.c").write_text(src)
    cmd = [
        stubcuda.find_compiler(),
        *stubcuda.CFLAGS,
        "-o",
        str(target),
        str(tmp_path / "broken.c"),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    # Planted as the builder leaves its own (0600, its sha256 beside it), so it is reused.
    target.chmod(0o600)
    hash_file = stubcuda._hash_path(target)
    hash_file.write_text(stubcuda._sha256(target))
    hash_file.chmod(0o600)
    assert stubcuda.reuse_problem(target) is None
    with CudnnWorker(env=dict(os.environ)) as w:
        r = w.probe(FusedAttnConfig().to_dict(), "h100")
    assert (r["supported"], r["decided"], r["code"]) == (False, False, "cudnn.stub_incomplete")
    assert any("lacks symbol(s) cuDNN asked for: cuLaunchKernel" in n for n in r["notes"])


def test_real_driver_status_here():
    # This machine class has no NVIDIA driver; a real one would make this a no-op check.
    status = stubcuda.real_driver_status()
    if not status.loadable:
        assert "libcuda.so.1" in status.detail


# ------------------------------------------------------------------------------ descriptors
@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_descriptor_files(name):
    d = load_descriptor(name)
    assert all(f in d for f in REQUIRED_FIELDS)
    assert set(d["_sources"]) >= set(REQUIRED_FIELDS)
    assert set(d["_estimated"]) <= set(d) - {"_sources", "_estimated", "_catalog"}
    sm = descriptor_sm(d)
    p = CATALOG[name]
    assert (sm, d["multiProcessorCount"]) == (p.sm, p.sm_count)
    assert d["totalGlobalMem"] == int(p.memory_gib * 2**30)
    for field, value in CC_LIMITS[sm].items():
        assert d[field] == value, field
    assert "_sources" not in json.loads(cudnn_json(d))
    assert descriptor_for(profile(name)) == d


def test_descriptor_for_other_profiles():
    d = descriptor_for(profile("h100:sm=100"))
    assert d["deviceVer"] == 1000 and d["_catalog"] is None and "smClockRateKHz" in d["_estimated"]
    d = synthesize_descriptor(87, 16, 32.0, "jetson")
    assert d["maxThreadsPerSM"] == CC_LIMITS[86]["maxThreadsPerSM"]
    with pytest.raises(DescriptorError):
        synthesize_descriptor(70, 80, 32.0, "volta")  # older than every CC_LIMITS row
    with pytest.raises(DescriptorError):
        descriptor_for(DeviceProfile("cpu-only"))
    with pytest.raises(DescriptorError):
        load_descriptor("nope")


# ------------------------------------------------------------------------------ pure helpers
def test_layout_strides():
    sizes = {"b": 2, "s": 10, "h": 4, "d": 8}
    assert strides_bhsd("bshd", sizes) == [320, 8, 32, 1]
    assert strides_bhsd("sbhd", sizes) == [32, 8, 64, 1]
    assert strides_bhsd("bhsd", sizes) == [320, 80, 8, 1]
    assert strides_bhsd("sb3hd", sizes) == [96, 8, 192, 1]
    assert strides_bhsd("bsh3d", sizes) == [960, 24, 96, 1]
    assert strides_bhsd("thd", sizes) == strides_bhsd("bshd", sizes)
    assert layout_pieces("bshd_bs2hd") == ("bshd", "bs2hd", "bs2hd")
    assert layout_pieces("paged_kv_thd_sbhd_sbhd") == ("thd", "sbhd", "sbhd")


def test_summarize_keeps_first_reason_per_engine():
    msg = (
        "No valid engine configs for __________\n"
        '{"engineId":6}\n'
        "Warning: X; Reason: Data type for Q should be half at: true\n"
        "Warning: X; Reason: generate_mha_fort()\n"
        "Warning: X; Reason: ptr->isSupported()\n"
        '{"engineId":7}\n'
        "Warning: X; Reason: Data type for Q should be half at: true\n"
    )
    assert summarize(msg) == "No valid engine configs for: Data type for Q should be half at: true"
    assert summarize("hidden_dim should be multiple of 8") == "hidden_dim should be multiple of 8"


def test_find_spec_matches_import():
    assert importlib.util.find_spec("cudnn") is not None
