"""Child process of test_addressing.py: our kernel on views whose row offsets pass 2^31 elements.

``python child_big_strides.py ROWS STRIDE_LOG2``: q, k and v are sbhd views ``[ROWS, 1, 1, 16]``
into one ``torch.empty`` buffer with sequence stride ``2**STRIDE_LOG2`` elements (the pages
between rows are never touched, so gigabytes of address space cost little memory). Runs
forward + backward in the Triton interpreter and prints the max errors against the reference
(relative to ``max(1, max|reference|)``) as JSON. A wrapped 32-bit address reads the wrong memory
or faults (hence a child process).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from te_fl_attention.kernels import triton_flash as tf  # noqa: E402
from te_fl_attention.kernels.reference import attention  # noqa: E402


def main(rows: int, stride_log2: int) -> None:
    stride, d = 2**stride_log2, 16
    buf = torch.empty(rows * stride, dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    packed = buf.as_strided((rows, 3 * d), (stride, 1))
    packed.copy_(torch.randn(rows, 3 * d, generator=g).half())
    q, k, v = (buf.as_strided((rows, 1, 1, d), (stride, d, d, 1), i * d) for i in range(3))
    assert (rows - 1) * stride >= 2**31, "the view must reach past 2^31 elements"
    do = torch.randn(rows, 1, 1, d, generator=g).half()
    got = [x.detach().requires_grad_() for x in (q, k, v)]
    out = tf.flash_attention(*got, qkv_format="sbhd", attn_mask_type="causal")
    grads = torch.autograd.grad(out, got, do)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = attention(*ref, qkv_format="sbhd", attn_mask_type="causal")
    wgrads = torch.autograd.grad(want, ref, do.float())
    names = ("out", "dq", "dk", "dv")
    errs = {n: (a.float() - b).abs().max().item() / max(1.0, b.abs().max().item())
            for n, a, b in zip(names, (out, *grads), (want, *wgrads), strict=True)}  # fmt: skip
    try:  # which addressing the launch used (absent before the 64-bit fix)
        plan = tf._plan(q, k, v, "sbhd", None, None, None, None, None, None, "causal", (-1, -1),
                        None, None)  # fmt: skip
        idx64 = tf._idx64(plan, (q, k, v), ())
    except AttributeError:
        idx64 = None
    print(json.dumps({"errors": errs, "idx64": idx64}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
