"""``OpImpl``, its kinds and availability (``plugin/ops/impl.py``)."""

from __future__ import annotations

import pytest
from ops_testutil import make_impl

from te_fl_attention.plugin.ops import (
    BackendImplKind,
    OpImpl,
)


def test_kind_values_and_te_fl_alias() -> None:
    assert BackendImplKind.DEFAULT is BackendImplKind.FLAGOS
    assert [str(k) for k in BackendImplKind] == ["flagos", "vendor", "reference"]
    assert make_impl("op", "flagos.x").kind is BackendImplKind.FLAGOS


def test_opimpl_validation() -> None:
    with pytest.raises(ValueError, match="needs a vendor"):
        OpImpl("op", "vendor.x", BackendImplKind.VENDOR, print)
    with pytest.raises(ValueError, match="kind='gpu'"):
        OpImpl("op", "gpu.x", "gpu", print)
    with pytest.raises(TypeError, match="not callable"):
        OpImpl("op", "flagos.x", "flagos", 3)  # type: ignore[arg-type]


def test_availability_sources() -> None:
    def te_fl_style() -> None: ...

    te_fl_style._is_available = lambda: False  # type: ignore[attr-defined]
    assert not make_impl("op", "flagos.a", te_fl_style).is_available()
    assert not make_impl("op", "flagos.b", available=lambda: 1 / 0).is_available()
    assert make_impl("op", "flagos.c", available=lambda: True).is_available()
    assert make_impl("op", "flagos.d").is_available()
