"""load_plugins() / uninstall() in-process, with a fake native module (no TE needed)."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest

from te_fl_attention.plugin import te as plugin
from te_fl_attention.plugin.ops import UnknownOpError
from te_fl_attention.plugin.router import FlashAttentionRouter
from te_fl_attention.plugin.te_backend import current, env_defaults
from te_fl_attention.policy import ENV_VARS


def fake_native() -> types.ModuleType:
    native = types.ModuleType("transformer_engine_torch")
    native.get_cudnn_version = lambda: 92801
    native.NVTE_Mask_Type = type("NVTE_Mask_Type", (), {})
    native.SOME_CONSTANT = 7
    return native


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*ENV_VARS, "TE_FL_PER_OP", "TE_FL_PLUGIN_MODULES", "TE_FL_ATTN_SEED_ENV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TE_FL_ATTN_DEVICE", "b200")
    monkeypatch.setenv("TE_FL_ATTN_CUDNN_PROBE", "0")
    for name in (plugin.MODULE_NAME, plugin.NATIVE_NAME):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(plugin, "_LOGGED", False)
    yield
    plugin.uninstall()


def test_no_native_module_raises_and_changes_nothing(clean: None) -> None:
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="compiled extension .* is not loaded"):
        plugin.load_plugins()
    assert plugin.MODULE_NAME not in sys.modules and plugin.NATIVE_NAME not in sys.modules
    assert dict(os.environ) == before and not plugin.installed()


def test_bad_registry_policy_rolls_back(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    native = fake_native()
    monkeypatch.setitem(sys.modules, plugin.MODULE_NAME, native)
    monkeypatch.setenv("TE_FL_STRICT", "maybe")
    with pytest.raises(ValueError, match="TE_FL_STRICT"):
        plugin.load_plugins()
    assert sys.modules[plugin.MODULE_NAME] is native
    assert plugin.NATIVE_NAME not in sys.modules and "NVTE_FUSED_ATTN" not in os.environ


def test_proxy_install_passthrough_and_uninstall(clean: None, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    native = fake_native()
    monkeypatch.setitem(sys.modules, plugin.MODULE_NAME, native)
    with caplog.at_level(logging.INFO, logger="te_fl_attention.plugin"):
        proxy = plugin.load_plugins()
        assert plugin.load_plugins() is proxy  # idempotent, logged once
    assert sys.modules[plugin.MODULE_NAME] is proxy
    assert sys.modules[plugin.NATIVE_NAME] is native
    assert proxy.get_attention_backend is plugin.get_attention_backend
    assert proxy.flash_attention is FlashAttentionRouter
    assert proxy.get_cudnn_version() == 92801  # a dispatcher over the native function
    assert proxy.get_cudnn_version.__name__ == "get_cudnn_version"
    assert proxy.NVTE_Mask_Type is native.NVTE_Mask_Type and proxy.SOME_CONSTANT == 7
    with pytest.raises(UnknownOpError):
        proxy.not_in_native  # noqa: B018
    assert getattr(proxy, "flash_attention_missing", None) is None  # hasattr-style probes work
    assert set(proxy.__all__) == {"get_cudnn_version", "NVTE_Mask_Type", "SOME_CONSTANT"}
    assert current().device.name == "b200"  # TE_FL_ATTN_DEVICE
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "device b200 (sm100, catalog)" in messages[0]
    assert all(os.environ.get(k) == v for k, v in env_defaults().items())  # seeded
    plugin.uninstall()
    assert sys.modules[plugin.MODULE_NAME] is native and not plugin.installed()
    assert "NVTE_FUSED_ATTN" not in os.environ and current() is None


def test_seeding_can_be_turned_off(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, plugin.MODULE_NAME, fake_native())
    monkeypatch.setenv("TE_FL_ATTN_SEED_ENV", "0")
    plugin.load_plugins(device="a100")
    assert "NVTE_FUSED_ATTN" not in os.environ and current().device.name == "a100"


def test_configure_changes_device_and_clears_memo(clean: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, plugin.MODULE_NAME, fake_native())
    plugin.load_plugins(device="h100")
    first = current()
    plugin.load_plugins(device="a100")  # a second call with a device reconfigures
    assert current() is not first and current().device.name == "a100"
    assert current().selector is first.selector


def test_candidates_here() -> None:
    from te_fl_attention.device import profile

    assert plugin.candidates_here(profile("h100")) == [
        "FusedAttention (cuDNN 9.28.1)", "FlashAttention 2 (flash-attn 2.8.3)",
        "TritonFlashAttention (triton 3.7.1)", "UnfusedDotProductAttention"]  # fmt: skip
    no_gpu = profile("h100").__class__(name="cpu", triton="3.7.1")
    assert plugin.candidates_here(no_gpu)[-1] == "UnfusedDotProductAttention"


def test_selection_errors_fall_back_to_te_original(clean: None, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """If our selection raises (here: an FP8 recipe we do not know), TE's own function answers,
    with one warning."""
    utils = types.ModuleType(plugin.DPA_UTILS)
    utils._original_get_attention_backend = lambda params: ("te's answer",)
    monkeypatch.setitem(sys.modules, plugin.DPA_UTILS, utils)
    monkeypatch.setitem(sys.modules, plugin.MODULE_NAME, fake_native())
    plugin.load_plugins(device="h100")

    class MysteryScaling:
        fp8_dpa = True

    params = types.SimpleNamespace(fp8=True, fp8_meta={"recipe": MysteryScaling()})
    with caplog.at_level(logging.WARNING, logger="te_fl_attention.plugin"):
        assert plugin.get_attention_backend(params) == ("te's answer",)
        assert plugin.get_attention_backend(params) == ("te's answer",)
    assert len(caplog.records) == 1 and "MysteryScaling" in caplog.records[0].getMessage()
    monkeypatch.delattr(utils, "_original_get_attention_backend")
    with pytest.raises(ValueError, match="MysteryScaling"):
        plugin.get_attention_backend(params)
