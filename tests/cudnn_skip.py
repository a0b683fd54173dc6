"""One module-level skip for test files that need cudnn-frontend (the ``[cudnn]`` extra)."""

from __future__ import annotations

import pytest


def require_cudnn() -> None:
    """Skip the calling test module unless ``import cudnn`` works (any failure to import, a
    missing library included, means "not installed here")."""
    try:
        import cudnn  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cudnn-frontend is not importable ({type(exc).__name__}: {exc}); install the"
                    " te-fl-attention[cudnn] extra (nvidia-cudnn-frontend, nvidia-cudnn-cu13,"
                    " nvidia-cublas)", allow_module_level=True)  # fmt: skip
