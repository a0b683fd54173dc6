"""Throughput of our Triton flash-attention kernel vs PyTorch SDPA (flash and cuDNN backends).

GPU only; on a machine without CUDA it prints one line saying so and exits 0. NOTE: this script
has never run on a GPU yet (it was written on a CPU-only machine); its numbers, and whether every
SDPA backend accepts every case, are unverified.

Cases: bf16, S in {1024, 4096, 8192}, D in {64, 128}, causal and not (batch * S = 16k tokens,
heads * D = 2048). For each it times the forward and the forward+backward pass of
``te_fl_attention.kernels.triton_flash.flash_attention`` (bshd) and of
``torch.nn.functional.scaled_dot_product_attention`` restricted to its flash and cuDNN backends
(the same tensors seen as [b, h, s, d] views): median of ``--reps`` runs between CUDA events,
after ``--warmup`` runs (the first of ours tunes its tiles, once per size bucket; the choices
are kept in the probe cache, so a second run does not tune). FLOPs: forward
``4 * b * h * S^2 * D`` (halved when causal), forward+backward 3.5x that.

One line per case:
    S=4096 D=128 causal=0 fwd triton=...ms (... TFLOP/s) sdpa=...ms (...) ratio=...x | fwdbwd ...
where ``ratio`` = best SDPA time / our time (> 1: ours is faster), then the summary line:
    bench_kernels cases=12 fwd_ratio_min=...x fwd_ratio_median=...x fwdbwd_ratio_min=...x ...
``--out FILE`` (or a directory: ``FILE/bench_kernels.json``) writes every case as JSON. Before
timing it checks one small case against SDPA's math backend and prints the max errors.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from te_fl_attention.kernels.tuning import time_ms  # noqa: E402

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (1024, 4096, 8192)
DIMS = (64, 128)


def skip_reason() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


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
        return time_ms(fwd, warmup, reps), time_ms(fwdbwd, warmup, reps)
    except RuntimeError as e:  # e.g. an SDPA backend that does not support this case
        print(f"  (skipped: {str(e).splitlines()[0][:120]})")
        return float("nan"), float("nan")


def _check(dev: torch.device) -> dict[str, float]:
    from torch.nn.attention import SDPBackend

    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(2, 300, 4, 72, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    do = torch.randn_like(q)
    worst: dict[str, float] = {}
    for causal in (False, True):
        got = _ours(causal)(q, k, v)
        ggot = torch.autograd.grad(got, (q, k, v), do)
        ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
        want = _sdpa(SDPBackend.MATH, causal)(*ref)
        gwant = torch.autograd.grad(want, ref, do.float())
        pairs = zip((got, *ggot), (want, *gwant), strict=True)
        errs = [(a.float() - b).abs().max().item() for a, b in pairs]
        for name, e in zip(("out", "dq", "dk", "dv"), errs, strict=True):
            worst[name] = max(worst.get(name, 0.0), e)
        print(f"check causal={int(causal)} max|err| vs SDPA math (fp32): out={errs[0]:.3g} "
              f"dq={errs[1]:.3g} dk={errs[2]:.3g} dv={errs[3]:.3g}")  # fmt: skip
    return worst


def _finite(values: list[float]) -> list[float]:
    return [x for x in values if math.isfinite(x)]


def run_case(s: int, d: int, causal: bool, warmup: int, reps: int, dev: torch.device
             ) -> dict[str, Any]:  # fmt: skip
    from torch.nn.attention import SDPBackend

    b, h = max(1, TOKENS // s), max(1, HIDDEN // d)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    do = torch.randn_like(q)
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    backends = {
        "triton": _ours(causal),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION, causal),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, causal),
    }
    ms = {name: _time(attn, q, k, v, do, warmup, reps) for name, attn in backends.items()}
    case: dict[str, Any] = {"S": s, "D": d, "causal": causal, "batch": b, "heads": h,
                            "dtype": "bf16", "ms": ms}  # fmt: skip
    for i, label in enumerate(("fwd", "fwdbwd")):
        f = flops * (1.0 if i == 0 else 3.5)
        sdpa = _finite([t[i] for n, t in ms.items() if n != "triton"])
        best = min(sdpa) if sdpa else float("nan")
        ours = ms["triton"][i]
        case[label] = {
            "triton_ms": ours, "sdpa_best_ms": best,
            "triton_tflops": f / ours / 1e9, "sdpa_best_tflops": f / best / 1e9,
            "ratio": best / ours,  # > 1: ours is faster
        }  # fmt: skip
    del q, k, v, do
    torch.cuda.empty_cache()
    return case


def _line(c: dict[str, Any]) -> str:
    parts = []
    for label in ("fwd", "fwdbwd"):
        x = c[label]
        parts.append(f"{label} triton={x['triton_ms']:.3f}ms ({x['triton_tflops']:.1f} TFLOP/s) "
                     f"sdpa={x['sdpa_best_ms']:.3f}ms ({x['sdpa_best_tflops']:.1f}) "
                     f"ratio={x['ratio']:.2f}x")  # fmt: skip
    return f"S={c['S']} D={c['D']} causal={int(c['causal'])} " + " | ".join(parts)


def summary(cases: list[dict[str, Any]]) -> str:
    out = [f"bench_kernels cases={len(cases)}"]
    for label in ("fwd", "fwdbwd"):
        r = _finite([c[label]["ratio"] for c in cases])
        lo = f"{min(r):.2f}x" if r else "nan"
        med = f"{statistics.median(r):.2f}x" if r else "nan"
        out.append(f"{label}_ratio_min={lo} {label}_ratio_median={med}")
    return " ".join(out) + " (best SDPA time / Triton time)"


def _plain(x: Any) -> Any:
    """JSON-safe: non-finite floats become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _write(path: Path, data: dict[str, Any]) -> Path:
    if path.is_dir():
        path = path / "bench_kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(data), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    ap.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, help="write the cases as JSON (a file, or a directory)")
    args = ap.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"bench_kernels: skipped: {reason}")
        if args.out:
            _write(args.out, {"skipped": reason})
        return 0
    from te_fl_attention.cache import tuning as cache_tuning

    cache_tuning.install()  # tuned tiles persist in the probe cache, as in the TE plugin
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}  torch {torch.__version__}")
    check = _check(dev)
    cases = []
    for d in args.dims:
        for s in args.seqlens:
            for causal in (False, True):
                case = run_case(s, d, causal, args.warmup, args.reps, dev)
                cases.append(case)
                print(_line(case), flush=True)
    line = summary(cases)
    if args.out:
        path = _write(args.out, {"device": torch.cuda.get_device_name(dev),
                                 "torch": torch.__version__, "check_max_err": check,
                                 "cases": cases, "summary": line})  # fmt: skip
        print(f"wrote {path}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
