"""64-bit addressing in the Triton kernel (issue 10, defect 7).

Row offsets ``row * seq_stride`` used to be 32-bit products: an sbhd tensor with
``S * B * H * D >= 2^31`` elements wrapped (illegal address or wrong output). Each case runs in a
child process (a wrapped address can fault) on views into a huge ``torch.empty`` buffer whose
pages stay untouched, and compares with the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    "rows,stride_log2,idx64",
    [
        (264, 23, False),  # row 256 * 2^23 = 2^31: 64-bit block bases, 32-bit in-block offsets
        (40, 26, True),  # 15 * 2^26 within one tile passes 2^31 too: 64-bit throughout
    ],
    ids=["block-bases", "in-block"],
)
def test_row_offsets_past_2_31_elements(rows, stride_log2, idx64):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "child_big_strides.py"), str(rows),
                           str(stride_log2)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {proc.stderr[-2000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["idx64"] is idx64
    for name, err in got["errors"].items():
        assert err < 5e-3, f"{name}: relative error {err:.3g} (a wrapped address read elsewhere)"
