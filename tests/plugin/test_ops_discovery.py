"""Plugin discovery (``plugin/ops/discovery.py``): env modules and entry points."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest
from ops_testutil import manager

from te_fl_attention.plugin.ops import (
    OpRegistry,
    discover_plugins,
)

HERE = Path(__file__).parent
FIXTURE = "tefl_fixture_plugin"


@pytest.fixture
def fixture_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.delitem(sys.modules, FIXTURE, raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])


def test_discovery_from_env_modules(fixture_on_path: None) -> None:
    reg = OpRegistry()
    records = discover_plugins(reg, {"TE_FL_PLUGIN_MODULES": f"{FIXTURE}, no_such_tefl_mod"})
    assert [(r.name, r.source, r.ok) for r in records] == [
        (FIXTURE, "env", True), ("no_such_tefl_mod", "env", False)]
    assert "ModuleNotFoundError" in records[1].error
    assert manager(reg).call("fixture_op") == "from fixture"


def test_discovery_from_entry_points(
    fixture_on_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = []
    ep = importlib.metadata.EntryPoint("fixture", f"{FIXTURE}:register", "te_fl.plugin")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: groups.append(kw) or [ep])
    reg = OpRegistry()
    records = discover_plugins(reg, {})
    assert groups == [{"group": "te_fl.plugin"}]
    assert [(r.name, r.source, r.ok) for r in records] == [("fixture", "entry_point", True)]
    assert reg.ops() == ["fixture_op"]
