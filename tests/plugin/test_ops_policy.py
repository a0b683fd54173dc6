"""Tokens and ``SelectionPolicy`` (``plugin/ops/policy.py``)."""

from __future__ import annotations

import pytest
from ops_testutil import make_impl

from te_fl_attention.plugin.ops import (
    SelectionPolicy,
    match_token,
)


def test_match_token() -> None:
    cuda = make_impl("op", "vendor.cuda", vendor="CUDA")
    assert match_token(cuda, "vendor") and match_token(cuda, "VENDOR:cuda")
    assert match_token(cuda, "impl:vendor.cuda")
    assert not match_token(cuda, "flagos") and not match_token(cuda, "vendor:metax")
    with pytest.raises(ValueError, match="unknown token 'cuda'"):
        match_token(cuda, "cuda")


def test_prefer_vendor_legacy_values() -> None:
    assert SelectionPolicy.from_env({"TE_FL_PREFER_VENDOR": "1"}).prefer == "vendor"
    legacy_off = SelectionPolicy.from_env({"TE_FL_PREFER_VENDOR": "0"})
    assert legacy_off.prefer == "flagos" and legacy_off.prefer_vendors == ()
    explicit = SelectionPolicy.from_env({"TE_FL_PREFER": "reference", "TE_FL_PREFER_VENDOR": "1"})
    assert explicit.prefer == "reference"


@pytest.mark.parametrize(
    ("value", "message"),
    [("rmsnorm_fwd=cuda", "unknown token 'cuda'"),
     ("rmsnorm_fwd=vendor:cuda|default", "old name for 'flagos'"),
     ("rmsnorm_fwd=vendor:", "unknown token 'vendor:'"),
     ("rmsnorm_fwd=impl:", "unknown token 'impl:'"),
     ("rmsnorm_fwd", "not of the form op=token"),
     ("rmsnorm_fwd=", "has no tokens"),
     ("=flagos", "empty op name"),
     ("a=flagos;a=vendor", "listed twice")],
)
def test_per_op_syntax_errors(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        SelectionPolicy.from_env({"TE_FL_PER_OP": value})
    assert "TE_FL_PER_OP" in str(info.value)
    if "token" in message:
        assert "vendor:NAME, impl:ID" in str(info.value)


def test_programmatic_policy_is_validated_and_normalized() -> None:
    policy = SelectionPolicy.from_dict(prefer="VENDOR", per_op_order={"op": ["Vendor:ACME"]},
                                       allow_vendors=[], deny_vendors=[" Foo "],
                                       prefer_vendors=["B", "b", "a"])
    assert policy == SelectionPolicy(prefer="vendor", per_op_order=(("op", ("vendor:acme",)),),
                                     deny_vendors=frozenset({"foo"}), prefer_vendors=("b", "a"))
    assert policy.allow_vendors is None and policy.vendor_names() == {"acme", "foo", "a", "b"}
    with pytest.raises(ValueError, match="prefer='gpu'"):
        SelectionPolicy(prefer="gpu")
    with pytest.raises(ValueError, match="per_op_order.*unknown token 'cuda'"):
        SelectionPolicy(per_op_order=(("op", ("cuda",)),))
