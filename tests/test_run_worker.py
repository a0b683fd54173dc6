"""GPU tiny runs in a worker process (te_fl_attention.run_worker), on CPU: the worker is a real
subprocess whose ``sitecustomize`` presents a GPU (tests/fakegpu), with tensors on CPU there."""

from __future__ import annotations

from pathlib import Path

import pytest

from te_fl_attention import problems
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.presets import preset
from te_fl_attention.probes.flash.probe import FlashAttnProbe
from te_fl_attention.run_worker import RunFailure, RunWorker
from te_fl_attention.workers import current_device

TESTS = str(Path(__file__).resolve().parent)
SMALL = FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16)


@pytest.fixture
def worker_factory():
    made = []

    def make(env, **kw):
        w = RunWorker(env=env, device=current_device(), **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.mark.parametrize("fake_gpu", ["h100:ordinal=3,count=8"], indirect=True)
def test_a_fault_in_the_worker_is_fa2s_reason(fake_gpu, fake_flash, worker_factory,
                                             monkeypatch):  # fmt: skip
    """deepseek-v3 (MLA 192/128) on the local (fake) H100, rank 3 of 8: FA2's tiny run goes to a
    worker on GPU 3 only, which runs FA2 (padded, the fake flash-attn checks v's head size),
    synchronizes, and reports the kernel's asynchronous illegal address as FA2's reason. The
    worker then exits (its context is poisoned); the next run gets a fresh one."""
    from fakegpu import ILLEGAL_ADDRESS

    from te_fl_attention import run_worker

    w = worker_factory(fake_gpu.child_env(flash=True, fault="illegal_address"))
    monkeypatch.setattr(run_worker, "get_worker", lambda device=None: w)
    config = FusedAttnConfig(**preset("deepseek-v3"))
    fa2 = FlashAttnProbe().probe(config, profile("local")).variants[2]
    assert fa2.backend == "fa2" and not fa2.supported and fa2.stage == "run"
    (why,) = fa2.reasons
    assert why.code == "fa2.run_failed" and why.stage == "run" and why.observed == "RuntimeError"
    assert ILLEGAL_ADDRESS in why.message
    assert w.hello["cuda_visible_devices"] == "3" and w.hello["cuda"] is True
    assert w.pid is None and w.starts == 1  # it left after the fault
    clean = worker_factory(fake_gpu.child_env(flash=True))  # no fault: the same run passes
    monkeypatch.setattr(run_worker, "get_worker", lambda device=None: clean)
    ok = FlashAttnProbe().probe(config, profile("local")).variants[2]
    assert ok.supported and ok.stage == "run" and "tiny run" in ok.evidence


def test_a_worker_that_dies_or_hangs_is_reported_and_replaced(fake_gpu, worker_factory):
    env = fake_gpu.child_env()
    env["PYTHONPATH"] = TESTS + ":" + env["PYTHONPATH"]
    w = worker_factory(env, setup="run_worker_helpers")
    note, exc = problems.tiny_run("fa2", SMALL, worker=w)  # its kernel calls os._exit(3)
    assert note is None and isinstance(exc, RunFailure) and exc.type_name == "WorkerDied"
    assert "exited with status 3 during the run" in str(exc) and "tiny run of fa2" in str(exc)
    assert problems.describe_error(exc).startswith("WorkerDied: the tiny-run worker (pid ")
    assert problems.tiny_run("unfused", SMALL, worker=w) == (None, None)  # a new worker
    assert w.starts == 2 and w.pid is not None
    note, exc = problems.tiny_run("triton", SMALL, worker=w, timeout_s=1.0)  # hangs
    assert isinstance(exc, RunFailure) and exc.type_name == "WorkerTimeout"
    assert "timed out after 1 s and was killed" in str(exc) and w.pid is None
    assert problems.tiny_run("unfused", SMALL, worker=w) == (None, None) and w.starts == 3
    note, exc = problems.tiny_run("fused", SMALL.replace(dtype="fp32"), worker=w)  # a note only
    assert exc is None and note.startswith("tiny run skipped: fused (torch SDPA's cuDNN backend)")
    assert "fp16/bf16" in note and w.starts == 3 and w.pid is not None  # it keeps serving


@pytest.mark.parametrize("fake_gpu", ["h100:ordinal=3,count=8"], indirect=True)
def test_each_device_has_its_own_worker_narrowed_to_it(fake_gpu):
    from te_fl_attention import run_worker

    w = run_worker.get_worker()
    assert w.device == 3 and run_worker.get_worker() is w
    assert w.spawn_env()["CUDA_VISIBLE_DEVICES"] == "3"
    fake_gpu.set_device(5)
    other = run_worker.get_worker()
    assert other is not w and other.device == 5


def test_without_cuda_the_worker_is_not_narrowed():
    import torch

    if torch.cuda.is_available():  # about a machine without a GPU
        pytest.skip("machine has a GPU")
    assert current_device() is None
    assert RunWorker(env={"A": "1"}).spawn_env()["A"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in RunWorker(env={"A": "1"}).spawn_env()


def test_cpu_tiny_runs_stay_in_process(monkeypatch):
    """Without CUDA nothing is spawned: the reference (and the interpreter) run here."""
    import torch

    if torch.cuda.is_available():  # about a machine without a GPU
        pytest.skip("machine has a GPU")
    from te_fl_attention import run_worker

    monkeypatch.setattr(run_worker, "get_worker",
                        lambda device=None: pytest.fail("spawned a worker"))  # fmt: skip
    assert problems.tiny_run("unfused", SMALL) == (None, None)


def test_a_worker_that_cannot_start_is_a_note_not_a_refusal(fake_gpu, worker_factory):
    w = worker_factory(fake_gpu.child_env(), setup="no_such_module_for_the_worker")
    note, exc = problems.tiny_run("unfused", SMALL, worker=w)
    assert exc is None and note.startswith("tiny run not run: the tiny-run worker exited with "
                                           "status 1 while starting; stderr: ")
    assert "No module named 'no_such_module_for_the_worker'" in note and w.pid is None
