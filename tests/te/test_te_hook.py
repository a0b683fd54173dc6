"""The NVTE_PLUGIN hook of the real TransformerEngine 2.20.2, driven on CPU.

Each test runs TE's own ``load_framework_extension`` plugin block and ``dot_product_attention``
import in a subprocess (see ``te_boot``); the only patch is the shared-object locator.
"""

from __future__ import annotations

PLUGIN_MODULE = """
import types
from te_fl_attention.plugin.ops import BackendImplKind, OpImpl
mod = types.ModuleType("tefl_test_ops")
def register(registry):
    registry.register(OpImpl("rmsnorm_fwd", "flagos.test", BackendImplKind.FLAGOS,
                             lambda *a, **k: "rmsnorm from the test plugin"))
mod.register = register
sys.modules["tefl_test_ops"] = mod
"""


def test_hook_installs_our_selector_router_and_proxy(te_script) -> None:
    report = te_script(PLUGIN_MODULE, """
    import logging, io
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("te_fl_attention.plugin").addHandler(handler)
    logging.getLogger("te_fl_attention.plugin").setLevel(logging.INFO)
    import te_boot, stub_tex
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        te_boot.boot()
    utils, dpa = te_boot.modules()
    import torch
    import te_fl_attention
    from te_fl_attention.plugin import te as plugin
    from te_fl_attention.plugin.router import FlashAttentionRouter
    from te_fl_attention.plugin.te_backend import BackendVersion
    import transformer_engine.pytorch.attention.dot_product_attention.backends as backends
    import transformer_engine.pytorch.cpp_extensions as cpp_ext
    tex = sys.modules["transformer_engine_torch"]
    native = sys.modules["transformer_engine_torch_nv"]
    original = utils._original_get_attention_backend
    try:
        tex.layernorm_fwd()
        reached = None
    except NotImplementedError as exc:
        reached = str(exc)
    params = utils.AttentionParams(qkv_dtype=torch.bfloat16, qkv_layout="bshd_bshd_bshd",
                                   attn_mask_type="causal", window_size=(-1, 0), num_heads=16,
                                   num_gqa_groups=16, head_dim_qk=128, head_dim_v=128)
    result = utils.get_attention_backend(params)
    os.environ["NVTE_FUSED_ATTN"] = "0"
    no_fused = utils.get_attention_backend(params)
    del os.environ["NVTE_FUSED_ATTN"]
    again = te_fl_attention.load_plugins()
    report(
        ours=utils.get_attention_backend is plugin.get_attention_backend,
        original_module=original.__module__, original_name=original.__name__,
        router=dpa.FlashAttention is FlashAttentionRouter,
        native_flash=dpa._FlashAttentionNative is backends.FlashAttention,
        proxy=type(tex).__name__, native_file=native.__file__, stub_file=stub_tex.__file__,
        tex_attrs=[tex.get_attention_backend is plugin.get_attention_backend,
                   tex.flash_attention is FlashAttentionRouter],
        reached=reached, enum_same=tex.NVTE_Mask_Type is native.NVTE_Mask_Type,
        cudnn=tex.get_cudnn_version(), plugin_op=tex.rmsnorm_fwd(),
        star_import=callable(getattr(cpp_ext, "layernorm_fwd", None)),
        result=[result[0], str(result[1]), result[2], result[3], type(result[3]).__name__,
                result[4], result[5]],
        result_version_type=type(result[1]).__name__,
        no_fused=[no_fused[0], str(no_fused[1]), no_fused[2], no_fused[3], no_fused[4]],
        idempotent=again is tex, warnings=[str(w.message) for w in caught
                                           if "plugin" in str(w.message).lower()],
        log=log.getvalue(),
    )
    """, env={"TE_FL_ATTN_DEVICE": "h100", "TE_FL_PLUGIN_MODULES": "tefl_test_ops"})
    assert report["ours"], report
    assert report["original_module"] == ("transformer_engine.pytorch.attention."
                                         "dot_product_attention.utils")
    assert report["original_name"] == "get_attention_backend"
    assert report["router"] and report["native_flash"]
    assert report["proxy"] == "TexProxy"
    assert report["native_file"] == report["stub_file"]
    assert report["tex_attrs"] == [True, True]
    # an op nobody registered reaches the native module (the stub raises naming itself)
    assert "layernorm_fwd" in report["reached"] and "CPU stub" in report["reached"]
    assert report["enum_same"] and report["cudnn"] == 92801
    assert report["plugin_op"] == "rmsnorm from the test plugin"  # TE_FL_PLUGIN_MODULES op
    assert report["star_import"]  # `from transformer_engine_torch import *` sees native names
    # h100, bf16, causal, d128: FusedAttention sub-backend 1 as a plain int (TE 2.20)
    assert report["result"] == [False, "2.8.3", True, 1, "int", False, [True, True, True]]
    assert report["result_version_type"] == "BackendVersion"
    assert report["no_fused"] == [True, "2.8.3", False, None, False]
    assert report["idempotent"]
    assert report["warnings"] == []
    log = report["log"]
    assert log.count("te-fl-attention installed via NVTE_PLUGIN hook") == 1
    assert "TransformerEngine 2.20.2" in log and "candidates here: FusedAttention" in log


def test_failing_load_plugins_leaves_te_native(te_script) -> None:
    """An invalid TE_FL_PER_OP makes load_plugins raise: TE rolls back and warns, and TE's own
    selector and FlashAttention stay in place."""
    report = te_script("""
    import te_boot, stub_tex
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        te_boot.boot()
    utils, dpa = te_boot.modules()
    import transformer_engine.pytorch.attention.dot_product_attention.backends as backends
    tex = sys.modules["transformer_engine_torch"]
    report(
        warnings=[f"{w.category.__name__}: {w.message}" for w in caught
                  if "plugin" in str(w.message).lower()],
        tex_file=getattr(tex, "__file__", None), stub_file=stub_tex.__file__,
        nv_alias="transformer_engine_torch_nv" in sys.modules,
        selector_module=utils.get_attention_backend.__module__,
        has_original=hasattr(utils, "_original_get_attention_backend"),
        flash_native=dpa.FlashAttention is backends.FlashAttention,
        seeded="NVTE_FUSED_ATTN" in os.environ,
    )
    """, env={"TE_FL_PER_OP": "rmsnorm_fwd=default"})
    assert len(report["warnings"]) == 1, report
    warning = report["warnings"][0]
    assert warning.startswith("RuntimeWarning: NVTE_PLUGIN=te_fl_attention but plugin loading "
                              "failed"), warning
    assert "TE_FL_PER_OP" in warning and "default" in warning
    assert report["tex_file"] == report["stub_file"]  # the native extension, not a proxy
    assert not report["nv_alias"]
    assert report["selector_module"].endswith("dot_product_attention.utils")
    assert not report["has_original"]
    assert report["flash_native"]
    assert not report["seeded"]  # the environment is left as found too


def test_install_and_uninstall_without_the_hook(te_script) -> None:
    """install() binds the same two names on a TE imported without NVTE_PLUGIN; uninstall()
    puts TE's back."""
    report = te_script("""
    import te_boot
    te_boot.boot(plugin=None)
    utils, dpa = te_boot.modules()
    import te_fl_attention
    from te_fl_attention.plugin import te as plugin
    from te_fl_attention.plugin.router import FlashAttentionRouter
    te_original, flash_original = utils.get_attention_backend, dpa.FlashAttention
    dpa._attention_backends["backend_selection_requires_update"] = False
    te_fl_attention.install(device="a100")
    installed = [utils.get_attention_backend is plugin.get_attention_backend,
                 utils._original_get_attention_backend is te_original,
                 dpa.FlashAttention is FlashAttentionRouter,
                 dpa._attention_backends["backend_selection_requires_update"]]
    te_fl_attention.install()  # idempotent
    twice = utils.get_attention_backend is plugin.get_attention_backend
    import torch
    params = utils.AttentionParams(qkv_dtype=torch.float16, qkv_layout="sbhd_sbhd_sbhd")
    a100 = utils.get_attention_backend(params)
    te_fl_attention.uninstall()
    restored = [utils.get_attention_backend is te_original,
                not hasattr(utils, "_original_get_attention_backend"),
                dpa.FlashAttention is flash_original, not hasattr(dpa, "_FlashAttentionNative"),
                "NVTE_FUSED_ATTN" not in os.environ]
    report(installed=installed, twice=twice, restored=restored,
           a100=[a100[0], str(a100[1]), a100[2], a100[3], a100[4]])
    """)
    assert report["installed"] == [True, True, True, True]
    assert report["twice"]
    assert report["restored"] == [True, True, True, True, True]
    assert report["a100"] == [True, "2.8.3", False, 1, False]  # sm80: flash before fused
