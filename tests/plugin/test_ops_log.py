"""The registry logger and ``TEFL_LOG_LEVEL`` (``plugin/ops/log.py``)."""

from __future__ import annotations

import logging

import pytest
from ops_testutil import Counter, fake_native, make_impl, manager

from te_fl_attention.plugin.ops import (
    LOGGER_NAME,
    OpRegistry,
    SelectionPolicy,
    configure_logging,
)


def test_log_line_once_per_op_and_impl(caplog: pytest.LogCaptureFixture) -> None:
    reg = OpRegistry()
    reg.register(make_impl("rmsnorm_fwd", "flagos.triton", Counter("flagos", fail=1)))
    mgr = manager(reg, fake_native())
    with caplog.at_level(logging.INFO, LOGGER_NAME):
        for _ in range(3):
            mgr.call("rmsnorm_fwd", 0)
    using = [r.getMessage() for r in caplog.records if "using" in r.getMessage()]
    assert using == [
        "Op 'rmsnorm_fwd' using 'vendor.cuda' (kind=vendor, vendor=cuda)",
        "Op 'rmsnorm_fwd' using 'flagos.triton' (kind=flagos, vendor=None)",
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'flagos.triton' failed for op 'rmsnorm_fwd'" in warnings[0].getMessage()


def test_tefl_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    log = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(log, "level", log.level)
    monkeypatch.setattr(log, "handlers", list(log.handlers))
    configure_logging({"TEFL_LOG_LEVEL": "debug"})
    assert log.level == logging.DEBUG
    SelectionPolicy.from_env({"TEFL_LOG_LEVEL": "Warning"})
    assert log.level == logging.WARNING
