"""``OpRegistry`` and native sources (``plugin/ops/registry.py``); the package import cost."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from ops_testutil import fake_native, make_impl, manager

from te_fl_attention.plugin.ops import (
    NoImplementationError,
    OpRegistry,
    register_native,
)

HERE = Path(__file__).parent


def test_registry_duplicates_replace_and_foreign_impls() -> None:
    reg = OpRegistry()
    reg.register(make_impl("op", "flagos.a"))
    with pytest.raises(ValueError, match="already has an implementation 'flagos.a'"):
        reg.register(make_impl("op", "flagos.a"))
    reg.register(make_impl("op", "flagos.a", lambda: "new"), replace=True)
    foreign = types.SimpleNamespace(op_name="op2", impl_id="reference.t", kind="reference",
                                    fn=lambda: "ref", vendor=None, priority=50)
    reg.register_impl(foreign)  # TE-FL spelling, duck-typed impl
    assert reg.ops() == reg.list_operators() == ["op", "op2"]
    assert reg.get_implementation("op", "flagos.a").fn() == "new"
    assert reg.get_implementations("op2")[0].priority == 50


def test_native_obeys_deny_list_and_registered_id_shadows_it() -> None:
    denied = manager(OpRegistry(), fake_native(), TE_FL_DENY_VENDORS="CUDA")
    with pytest.raises(NoImplementationError, match="'vendor.cuda' excluded by TE_FL_ALLOW"):
        denied.call("rmsnorm_fwd", 1)
    reg = OpRegistry()
    register_native(reg, fake_native())
    reg.register(make_impl("rmsnorm_fwd", "vendor.cuda", vendor="cuda"))
    assert [i.fn for i in reg.impls("rmsnorm_fwd")][0]() == "vendor.cuda"
    assert len(reg.impls("rmsnorm_fwd")) == 1


def test_import_is_light() -> None:
    code = ("import sys, te_fl_attention.plugin.ops; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parents[1])
