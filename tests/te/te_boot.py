"""Import the real TransformerEngine 2.20.2 on a CPU machine, through TE's own loader.

For subprocess tests (TE's module state cannot be reset in-process). :func:`boot` sets
``NVTE_PROJECT_BUILDING=1`` (TE's own switch that skips loading its CUDA libraries at import),
optionally ``NVTE_PLUGIN``, and patches exactly one thing in TE:

* ``transformer_engine.common._get_shared_object_file`` answers ``library="torch"`` with the path
  of :mod:`stub_tex` (a Python file) instead of searching for the compiled ``.so``; every other
  library goes to TE's own function.

Everything else is TE's code: ``load_framework_extension("torch")`` loads the stub through
``importlib.util.spec_from_file_location``, checks its cuDNN version, and, with ``NVTE_PLUGIN``,
runs its plugin block (``transformer_engine_torch_nv`` alias, ``import_module``,
``load_plugins()``, rollback + ``RuntimeWarning`` on failure); ``dot_product_attention.py`` runs
its own plugin block at import.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import Any

STUB_PATH = Path(__file__).resolve().with_name("stub_tex.py")
DPA_UTILS = "transformer_engine.pytorch.attention.dot_product_attention.utils"
DPA_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"


def boot(plugin: str | None = "te_fl_attention") -> Any:
    """Import ``transformer_engine.pytorch``; returns the ``transformer_engine.common`` module."""
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    if plugin:
        os.environ["NVTE_PLUGIN"] = plugin
    else:
        os.environ.pop("NVTE_PLUGIN", None)
    common = importlib.import_module("transformer_engine.common")
    original = common._get_shared_object_file

    @functools.cache
    def shared_object_file(library: str) -> Path:
        return STUB_PATH if library == "torch" else original(library)

    common._get_shared_object_file = shared_object_file
    importlib.import_module("transformer_engine.pytorch")
    return common


def modules() -> tuple[Any, Any]:
    """TE's ``dot_product_attention.utils`` and ``dot_product_attention`` modules."""
    return sys.modules[DPA_UTILS], sys.modules[DPA_MODULE]
