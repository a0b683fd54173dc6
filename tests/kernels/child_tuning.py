"""Child process of test_tuning.py: one "job" that runs our kernel on a presented GPU.

Started with ``FakeGPU.child_env()`` (an H100 installed by ``sitecustomize``), the probe cache at
``TE_FL_ATTN_CACHE`` and ``TRITON_INTERPRET=1``. It installs the probe-cache tuning store the way
the plugin does (:func:`te_fl_attention.cache.tuning.install`), replaces the kernel launches by
the launch double, runs forward + backward of a tiny bf16 case, checks the result against the
reference and prints one JSON line: how many candidate timings it did, the tiles it launched and
the max error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from launch_double import install_forever  # noqa: E402

from te_fl_attention.cache import tuning as cache_tuning  # noqa: E402
from te_fl_attention.kernels import triton_flash as tf  # noqa: E402
from te_fl_attention.kernels import tuning  # noqa: E402
from te_fl_attention.kernels.reference import attention  # noqa: E402


def main() -> None:
    assert torch.cuda.is_available(), "the fake GPU is not installed (sitecustomize)"
    log = install_forever()
    cache_tuning.install()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 16, generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    do = torch.randn(1, 24, 2, 16, generator=g).to(torch.bfloat16)
    out = tf.flash_attention(q, k, v, attn_mask_type="causal")
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = attention(*ref, attn_mask_type="causal")
    wgrads = torch.autograd.grad(want, ref, do.float())
    err = max((a.float() - b).abs().max().item()
              for a, b in zip((out, *grads), (want, *wgrads), strict=True))  # fmt: skip
    t = tuning.tuner()
    print(json.dumps({
        "benchmarks": t.benchmarks, "tunings": t.tunings,
        "events": [how for how, _, _ in t.events],
        "launched": {n: list(log.of(n)[-1].config) for n in ("fwd", "dq", "dkdv")},
        "max_err": err,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
