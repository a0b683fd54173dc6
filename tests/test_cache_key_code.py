"""The cache key covers every source that can change a verdict: edit one in a copy of the package
and a warm store answers with a miss (the probes run again), never a stale hit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import te_fl_attention
from te_fl_attention.cache.keys import VERDICT_CODE

PACKAGE = Path(te_fl_attention.__file__).resolve().parent

#: One module per room that decides (the probe modules themselves were covered before).
EDITED = ("probes/fused/graph.py", "probes/fused/worker.py", "probes/fused/stubcuda.py",
          "probes/fused/stubcuda.c", "probes/common.py", "kernels/triton_flash.py",
          "kernels/flash_kernels.py", "config.py", "config_te.py", "backends.py", "problems.py",
          "workers.py",
          "descriptors/h100.json")  # fmt: skip

SCRIPT = """
import sys
import te_fl_attention
from te_fl_attention import FusedAttnConfig, Selector
from te_fl_attention.cache import ProbeCache
from te_fl_attention.probes import default_probes
assert te_fl_attention.__file__.startswith(sys.argv[2]), te_fl_attention.__file__
sel = Selector(default_probes(graph=False), cache=ProbeCache(sys.argv[1]))
print(sel.decide(FusedAttnConfig(), "h100").source)
"""


def _source(root: Path, store: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(store), str(root)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pkg")
    shutil.copytree(PACKAGE, root / "te_fl_attention",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return root


def test_every_edited_room_is_in_the_digest():
    for rel in EDITED:
        assert (PACKAGE / rel).is_file(), rel
        assert any(rel == v or rel.startswith(v + "/") for v in VERDICT_CODE), rel


@pytest.mark.parametrize("rel", EDITED)
def test_an_edit_to_code_that_decides_is_a_miss_not_a_stale_hit(copy, tmp_path, rel):
    store = tmp_path / "probes.sqlite"
    assert _source(copy, store) == "probe"
    assert _source(copy, store) == "cache"  # warm: the rows are found
    target = copy / "te_fl_attention" / rel
    original = target.read_bytes()
    comment = b"\n" if rel.endswith(".json") else b"\n// edited\n" if rel.endswith(".c") else \
        b"\n# edited\n"  # fmt: skip
    try:
        target.write_bytes(original + comment)
        assert _source(copy, store) == "probe"  # new code: the old rows are not served
    finally:
        target.write_bytes(original)
    assert _source(copy, store) == "cache"  # the old code again: its rows are still there
