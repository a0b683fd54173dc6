"""Suite-wide isolation: the probe cache lives in a temporary file, never the user's cache."""

from __future__ import annotations

import os
import tempfile

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
