"""``TE_FL_*`` value parsing (``plugin/ops/env.py``), through ``SelectionPolicy.from_env``."""

from __future__ import annotations

import pytest

from te_fl_attention.plugin.ops import (
    SelectionPolicy,
)


@pytest.mark.parametrize(
    ("var", "value"),
    [("TE_FL_PREFER", "gpu"), ("TE_FL_STRICT", "maybe"), ("TEFL_LOG_LEVEL", "loud")],
)
def test_invalid_env_values(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{var}='{value}' is not valid: expected one of"):
        SelectionPolicy.from_env({var: value})


@pytest.mark.parametrize(("value", "strict"), [("", False), ("0", False), ("off", False),
                                                ("1", True), ("TRUE", True), ("yes", True)])
def test_strict_values(value: str, strict: bool) -> None:
    assert SelectionPolicy.from_env({"TE_FL_STRICT": value}).strict is strict
