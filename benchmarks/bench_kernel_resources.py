"""Registers, spill bytes and shared memory of our Triton kernels, compiled ahead of time on CPU.

No GPU needed: every tile the tuner keeps (``te_fl_attention.kernels.triton_flash.configs``) is
compiled with Triton's own compiler (``triton.compile`` on an ``ASTSource``, target
``GPUTarget("cuda", 80 | 90, 32)``, Triton's bundled ``ptxas``) and its cubin read with the
bundled ``cuobjdump --dump-resource-usage``. Kernels: forward, dQ and dK/dV; head dims 64, 128,
256; bf16 and fp16; two specializations each: ``plain`` (no mask, MHA) and ``causal_gqa``
(causal, two q heads per kv head). The arguments are the ones the kernel's own launchers build
(captured from ``_forward`` / ``_backward``) and are specialized the way a JIT launch
specializes them (16-byte alignment, unit strides as constants), with the GPU's constants
(no fp32 upcast, tensor-core dot precision).

Target at head dim <= 128, on sm80 and sm90, for every kept config (``SPILL_TARGET``): the
forward spills 0 bytes, dQ and dK/dV at most 256 (spill bytes = the stack frame ``ptxas``
allocates, what the driver reports as local memory per thread). Head dim 256 is reported, not
held to the target (its own small fallback tiles). The configs that were measured over the
target and left out of the list (``DROPPED``) are compiled too, to show why (``--kept-only``
skips them); they count in no total.

Prints one row per kernel x head dim x dtype x config x specialization with sm80 and sm90
registers / spill bytes / shared memory, then, last, exactly:
    kernel_resources configs=N spilling=K max_spill_bytes=B
N = kept (kernel, head dim, dtype, config) entries measured; K = kept entries at head dim <= 128
over the target on some arch or specialization (should be 0); B = the largest spill of a kept
entry at head dim <= 128. ``--out FILE`` writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # compile real kernels (set before triton is imported)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNELS = ("fwd", "dq", "dkdv")
LABELS = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV"}
DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
ARCHS = (80, 90)
VARIANTS = ("plain", "causal_gqa")
TARGET_MAX_DIM = 128


def _tf() -> Any:
    from te_fl_attention.kernels import triton_flash

    return triton_flash


@functools.cache
def captured(d: int, dtype: str, variant: str) -> dict[str, tuple[tuple, dict]]:
    """kernel -> (args, consts) exactly as the launchers pass them (CPU tensors stand in)."""
    import torch

    tf = _tf()
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    h, hkv = (4, 2) if variant == "causal_gqa" else (4, 4)
    mask = "causal" if variant == "causal_gqa" else "no_mask"
    b, s = 2, 1024
    q = torch.empty(b, s, h, d, dtype=tdtype)
    k = torch.empty(b, s, hkv, d, dtype=tdtype)
    v = torch.empty(b, s, hkv, d, dtype=tdtype)
    got: dict[str, tuple[tuple, dict]] = {}

    def record(name, p, rows, batch_heads, args, consts, split=False):
        got[name] = (args, dict(consts))

    saved = (tf._launch, tf._launch_delta, tf.interpreting)
    tf._launch, tf._launch_delta = record, lambda *a, **kw: None
    tf.interpreting = lambda: True  # CPU tensors pass validation; constants fixed below
    try:
        p = tf._plan(q, k, v, "bshd", None, None, None, None, None, None, mask, (-1, -1), None,
                     None)  # fmt: skip
        out, lse = tf._forward(q, k, v, p)
        tf._backward(q, k, v, out, lse, torch.empty_like(out), p)
    finally:
        tf._launch, tf._launch_delta, tf.interpreting = saved
    for _, consts in got.values():
        consts.update(UPCAST=False, DOT_PREC=None, IDX64=False)
    return got


def specialize(kernel: Any, args: tuple, consts: dict, cfg: Any) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a JIT launch of ``kernel`` with these arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    values = {**consts, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
    sig: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int], list] = {}
    positional = iter(args)
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
            constexprs[name] = values[name]
            continue
        value = next(positional)
        ty, attr = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)  # fmt: skip
        sig[name] = ty
        if ty == "constexpr":
            constexprs[name] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    return sig, constexprs, attrs


_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def measure(job: tuple[str, int, str, str, tuple[int, int, int, int], int]) -> dict[str, Any]:
    """Compile one (kernel, head dim, dtype, variant, config, arch); its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import knobs
    from triton.compiler import ASTSource

    from te_fl_attention.kernels.tuning import Config

    name, d, dtype, variant, cfg_t, arch = job
    cfg = Config(*cfg_t)
    tf = _tf()
    kernel = tf._kernel(name)
    args, consts = captured(d, dtype, variant)[name]
    sig, constexprs, attrs = specialize(kernel, args, consts, cfg)
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    elapsed = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", fh.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    m = _RESOURCE.search(text)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {job}: {text[:500]}")
    regs, stack, static_smem, local = map(int, m.groups())
    return {"kernel": name, "head_dim": d, "dtype": dtype, "variant": variant,
            "config": cfg.name, "arch": arch, "registers": regs, "spill_bytes": stack,
            "local_bytes": local, "shared_bytes": int(compiled.metadata.shared) + static_smem,
            "compile_s": round(elapsed, 2)}  # fmt: skip


def kept_configs(name: str, d: int, dtype: str) -> tuple:
    return _tf().configs(name, dtype, d, d)


def dropped_configs(name: str, d: int) -> tuple:
    return _tf().DROPPED.get(name, {}).get(d, ())


def over_target(row: dict[str, Any]) -> bool:
    return row["spill_bytes"] > _tf().SPILL_TARGET[row["kernel"]]


def jobs(kernels, dims, dtypes, archs, variants, dropped: bool,
         only: set[str] | None = None) -> list[tuple]:  # fmt: skip
    out = []
    for name in kernels:
        for d in dims:
            for dtype in dtypes:
                cfgs = list(kept_configs(name, d, dtype))
                if dropped:
                    cfgs += [c for c in dropped_configs(name, d) if c not in cfgs]
                for cfg in cfgs:
                    if only and cfg.name not in only:
                        continue
                    t = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
                    out += [(name, d, dtype, var, t, arch) for var in variants for arch in archs]
    return out


def _fmt(rows: list[dict[str, Any]], archs) -> list[str]:
    """One line per (kernel, head dim, dtype, config, variant): each arch's regs/spill/smem."""
    tf = _tf()
    by: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        by.setdefault((r["kernel"], r["head_dim"], r["dtype"], r["config"], r["variant"]),
                      {})[r["arch"]] = r  # fmt: skip
    order = {k: i for i, k in enumerate(KERNELS)}
    head = f"{'kernel':<8}{'D':>4} {'dtype':<5} {'config':<12} {'variant':<11}"
    head += "".join(f"  sm{a}: regs spill  smem KiB" for a in archs) + "  status"
    lines = [head]
    for key in sorted(by, key=lambda k: (order[k[0]], k[1], k[2], k[3], k[4])):
        name, d, dtype, cfg_name, variant = key
        line = f"{LABELS[name]:<8}{d:>4} {dtype:<5} {cfg_name:<12} {variant:<11}"
        for a in archs:
            r = by[key].get(a)
            if r is None:
                line += f"  sm{a}: {'-':>4} {'-':>5} {'-':>9}"
            else:
                kib = r["shared_bytes"] / 1024
                line += f"  sm{a}: {r['registers']:>4} {r['spill_bytes']:>5} {kib:>9.1f}"
        kept = any(c.name == cfg_name for c in kept_configs(name, d, dtype))
        over = any(over_target(r) for r in by[key].values())
        if not kept:  # the worst spill of this config over both archs and specializations
            worst = max(r["spill_bytes"] for r in rows if (r["kernel"], r["head_dim"],
                        r["dtype"], r["config"]) == key[:4])  # fmt: skip
            status = f"dropped (up to {worst} B)"
        elif d > TARGET_MAX_DIM:
            status = "kept (D>128: reported)"
        else:
            status = f"kept{' OVER TARGET' if over else ''} (target {tf.SPILL_TARGET[name]})"
        lines.append(line + "  " + status)
    return lines


def summarize(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(N kept entries, K kept entries at D <= 128 over target, B max spill of those)."""
    kept_rows = [r for r in rows if any(c.name == r["config"]
                                        for c in kept_configs(r["kernel"], r["head_dim"],
                                                              r["dtype"]))]  # fmt: skip
    entries = {(r["kernel"], r["head_dim"], r["dtype"], r["config"]) for r in kept_rows}
    target = [r for r in kept_rows if r["head_dim"] <= TARGET_MAX_DIM]
    spilling = {(r["kernel"], r["head_dim"], r["dtype"], r["config"])
                for r in target if over_target(r)}  # fmt: skip
    max_spill = max((r["spill_bytes"] for r in target), default=0)
    return len(entries), len(spilling), max_spill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--dims", nargs="+", type=int, default=list(DIMS), choices=DIMS)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--archs", nargs="+", type=int, default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--kept-only", action="store_true",
                    help="skip the dropped configs (compiled by default: they show the pruning)")
    ap.add_argument("--config", nargs="+", help="only these configs (names like m64n64w4s3)")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (at most 2)")
    ap.add_argument("--out", type=Path, help="write every measurement as JSON here")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_resources: triton is not installed; nothing compiled")
        print("kernel_resources configs=0 spilling=0 max_spill_bytes=0")
        return 0
    todo = jobs(args.kernels, args.dims, args.dtypes, args.archs, args.variants, not args.kept_only,
                set(args.config or ()))
    t0 = time.perf_counter()
    print(f"compiling {len(todo)} kernels (triton {triton.__version__}, "
          f"{min(max(args.jobs, 1), 2)} processes)...", flush=True)  # fmt: skip
    workers = min(max(args.jobs, 1), 2)
    if workers == 1:
        rows = [measure(j) for j in todo]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            rows = list(pool.map(measure, todo))
    for line in _fmt(rows, args.archs):
        print(line)
    n, k, b = summarize(rows)
    print(f"measured {len(rows)} kernels in {time.perf_counter() - t0:.0f} s (Triton's on-disk "
          f"cache reused where warm); target at D<=128: forward 0 spill bytes, dQ and dK/dV "
          f"<= 256 (sm{'/sm'.join(map(str, args.archs))})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "configs": n, "spilling": k,
                                        "max_spill_bytes": b}, indent=1))  # fmt: skip
    print(f"kernel_resources configs={n} spilling={k} max_spill_bytes={b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
