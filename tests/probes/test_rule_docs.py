"""Every rule of every probe says which behaviour it mirrors, under a name unique in its module."""

from __future__ import annotations

import inspect

import pytest

from te_fl_attention.probes import common, triton, unfused
from te_fl_attention.probes.flash import fa2 as flash_fa2
from te_fl_attention.probes.flash import fa3 as flash_fa3
from te_fl_attention.probes.flash import fa4 as flash_fa4
from te_fl_attention.probes.flash import rules as flash_rules
from te_fl_attention.probes.fused import rules as fused_rules
from te_fl_attention.probes.fused import table as fused_table

RULE_TUPLES = {
    "fused.rules.PYTHON_RULES": fused_rules.PYTHON_RULES,
    "fused.table.TABLE_RULES": fused_table.TABLE_RULES,
    "fused.rules.determinism": (fused_rules.determinism,),
    "common.ALL_BACKENDS": common.ALL_BACKENDS,
    "flash.rules.SHARED": flash_rules.SHARED,
    "flash.fa2.FA2": flash_fa2.FA2,
    "flash.fa3.FA3": flash_fa3.FA3,
    "flash.fa4.FA4": flash_fa4.FA4,
    "triton.TritonFlashProbe.RULES": triton.TritonFlashProbe.RULES,
    "unfused.UnfusedProbe.RULES": unfused.UnfusedProbe.RULES,
}


@pytest.mark.parametrize("where", list(RULE_TUPLES))
def test_every_rule_has_a_docstring(where):
    """Every rule says which behaviour it mirrors; rules mirroring TE name TE (or its C++ API)."""
    mirrors_te = not where.startswith("triton.")
    for rule in RULE_TUPLES[where]:
        doc = inspect.getdoc(rule)
        assert doc and len(doc) >= 20, f"{where}: {rule.__name__} has no docstring"
        if mirrors_te and rule.__name__ != "requires_gpu":
            assert "TE" in doc or "nvte_" in doc, f"{where}: {rule.__name__}: {doc!r}"
    if where.startswith("triton."):  # our own features: each says what it refuses
        for rule in triton.UNSUPPORTED:
            assert inspect.getdoc(rule).startswith("Refuse ")


def test_rule_names_are_unique_per_module():
    for where, rules in RULE_TUPLES.items():
        names = [r.__name__ for r in rules]
        assert len(names) == len(set(names)), where


# ------------------------------------------------------------- issue 12: env parsing, force
