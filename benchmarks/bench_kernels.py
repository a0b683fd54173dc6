"""Throughput of our Triton flash-attention kernel vs PyTorch SDPA (flash and cuDNN backends).

GPU only. NOTE: this script has never run on a GPU yet (it was written on a CPU-only machine);
its numbers, and whether every SDPA backend accepts every case, are unverified.

For bf16, causal and not, D in {64, 128} and S in {1024, 4096, 16384} (batch * S = 16k tokens,
heads * D = 2048), it measures the forward and the forward+backward pass of
``te_fl_attention.kernels.triton_flash.flash_attention`` (bshd) and of
``torch.nn.functional.scaled_dot_product_attention`` restricted to its flash and cuDNN backends
(same bshd tensors seen as [b, h, s, d] views). Each timing is the median of ``--reps`` runs
timed with CUDA events after ``--warmup`` runs (the warm-up includes Triton's autotuning).
FLOPs: forward ``4 * b * h * S^2 * D`` (halved when causal), forward+backward 3.5x that.

Prints, per case, one line with TFLOP/s and the ratio of ours to the best SDPA backend:
    S=4096 D=128 causal=0 fwd triton=... flash=... cudnn=... TFLOP/s ratio=...x | fwdbwd ...
and finally the summary (the worse of causal and non-causal):
    triton_vs_sdpa_best S=4096 D=128 fwd=...x fwdbwd=...x (target >= 0.8x)
Before timing it checks one small case against SDPA's math backend and prints the max errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TOKENS = 16384
HIDDEN = 2048


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench_kernels: needs triton (pip install triton); nothing run")


def _median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _sdpa(backend, causal: bool):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):  # bshd in, bshd out
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
        return out.transpose(1, 2)

    return run


def _ours(causal: bool):
    from te_fl_attention.kernels.triton_flash import flash_attention

    mask = "causal" if causal else "no_mask"
    return lambda q, k, v: flash_attention(q, k, v, attn_mask_type=mask)


def _time(attn, q, k, v, do, warmup: int, reps: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms); nan when the backend refuses the case."""

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwdbwd():
        out = attn(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    try:
        return _median_ms(fwd, warmup, reps), _median_ms(fwdbwd, warmup, reps)
    except RuntimeError as e:  # e.g. an SDPA backend that does not support this case
        print(f"  (skipped: {str(e).splitlines()[0][:120]})")
        return float("nan"), float("nan")


def _check(dev: torch.device) -> None:
    from torch.nn.attention import SDPBackend

    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(2, 300, 4, 72, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    do = torch.randn_like(q)
    for causal in (False, True):
        got = _ours(causal)(q, k, v)
        ggot = torch.autograd.grad(got, (q, k, v), do)
        ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
        want = _sdpa(SDPBackend.MATH, causal)(*ref)
        gwant = torch.autograd.grad(want, ref, do.float())
        pairs = zip((got, *ggot), (want, *gwant), strict=True)
        errs = [(a.float() - b).abs().max().item() for a, b in pairs]
        print(
            f"check causal={int(causal)} max|err| vs SDPA math (fp32): out={errs[0]:.3g} "
            f"dq={errs[1]:.3g} dk={errs[2]:.3g} dv={errs[3]:.3g}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    _need_cuda()
    from torch.nn.attention import SDPBackend

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}  torch {torch.__version__}")
    _check(dev)
    summary: dict[bool, tuple[float, float]] = {}
    for d in args.dims:
        for s in args.seqlens:
            for causal in (False, True):
                b, h = max(1, TOKENS // s), max(1, HIDDEN // d)
                q, k, v = (
                    torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).requires_grad_()
                    for _ in range(3)
                )
                do = torch.randn_like(q)
                flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                backends = {
                    "triton": _ours(causal),
                    "flash": _sdpa(SDPBackend.FLASH_ATTENTION, causal),
                    "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, causal),
                }
                tflops = {}
                for name, attn in backends.items():
                    f_ms, fb_ms = _time(attn, q, k, v, do, args.warmup, args.reps)
                    tflops[name] = (flops / f_ms / 1e9, 3.5 * flops / fb_ms / 1e9)
                parts, ratios = [], []
                for i, label in enumerate(("fwd", "fwdbwd")):
                    best = max(
                        (t[i] for n, t in tflops.items() if n != "triton" and t[i] == t[i]),
                        default=float("nan"),
                    )
                    ratio = tflops["triton"][i] / best
                    ratios.append(ratio)
                    parts.append(
                        f"{label} triton={tflops['triton'][i]:.1f} flash={tflops['flash'][i]:.1f}"
                        f" cudnn={tflops['cudnn'][i]:.1f} TFLOP/s ratio={ratio:.2f}x"
                    )
                print(f"S={s} D={d} causal={int(causal)} " + " | ".join(parts), flush=True)
                if s == 4096 and d == 128:
                    summary[causal] = (ratios[0], ratios[1])
                del q, k, v, do
                torch.cuda.empty_cache()
    if summary:
        fwd = min(r[0] for r in summary.values())
        fwdbwd = min(r[1] for r in summary.values())
        print(
            f"triton_vs_sdpa_best S=4096 D=128 fwd={fwd:.2f}x fwdbwd={fwdbwd:.2f}x (target >= 0.8x)"
        )
    else:
        print("triton_vs_sdpa_best S=4096 D=128 not measured (S=4096 and D=128 not both selected)")


if __name__ == "__main__":
    main()
