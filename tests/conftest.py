"""Suite-wide isolation: the probe cache lives in a temporary file, never the user's cache."""

from __future__ import annotations

import os
import tempfile

import pytest

_CACHE_DIR = tempfile.mkdtemp(prefix="te-fl-attn-tests-")
os.environ.setdefault("TE_FL_ATTN_CACHE", os.path.join(_CACHE_DIR, "probes.sqlite"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip cleanly on a machine without CUDA."""
    import pytest

    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------------------ the hardware seam
def _fake_gpu_fixture():
    import pytest

    @pytest.fixture
    def fake_gpu(request, monkeypatch):
        """A GPU presented through the calls that need one (``tests/fakegpu``): an H100 unless
        the test is parametrized indirectly with ``"b200"`` (or ``"h100:ordinal=3,count=8"``)."""
        from fakegpu import parse_env, reset_process_state

        gpu = parse_env(getattr(request, "param", "h100")).install(monkeypatch)
        yield gpu
        monkeypatch.undo()
        reset_process_state()

    @pytest.fixture
    def fake_flash(monkeypatch):
        """The flash-attn 2.8.3 test double installed on ``sys.path`` (metadata and modules);
        yields its call log."""
        import importlib
        import sys

        from fakegpu import FLASH_SITE

        monkeypatch.syspath_prepend(str(FLASH_SITE))
        importlib.invalidate_caches()
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            monkeypatch.delitem(sys.modules, name)
        from flash_attn import flash_attn_interface

        flash_attn_interface.CALLS.clear()
        yield flash_attn_interface.CALLS
        monkeypatch.undo()
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
        importlib.invalidate_caches()

    return fake_gpu, fake_flash


fake_gpu, fake_flash = _fake_gpu_fixture()


@pytest.fixture
def new_job(tmp_path, monkeypatch):
    """``new_job(name)``: the process-wide selector and default store start afresh on
    ``tmp_path / name`` (a new job on that store); ``new_job()``: a new selector on the same store.
    Both are reset afterwards."""
    from te_fl_attention import selector
    from te_fl_attention.cache import tiered

    def use(name: str | None = None) -> None:
        if name is not None:
            monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / name))
            tiered.reset_default_cache()
        selector._DEFAULT = None

    yield use
    selector._DEFAULT = None
    tiered.reset_default_cache()
