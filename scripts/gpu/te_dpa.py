"""TE's ``DotProductAttention`` forward + backward with our plugin vs without it, same inputs.

Runs at least 10 configs of :mod:`families` (the runnable families) twice, each time in a fresh
process: once with ``NVTE_PLUGIN=te_fl_attention`` (TE asks us, our router may run our Triton
kernel) and once natively. Both get the same seeded q/k/v (and bias, output gradient); each
records the backend TE ran and ``out``, ``dq``, ``dk``, ``dv``. The parent prints one line per
config and a summary::

    te_dpa family=gqa plugin=FusedAttention native=FusedAttention out=0 dq=0 dk=0 dv=0
    te_dpa configs=N same_backend=S max_err_out=E max_err_grad=G

(errors: ``max|a - b| / (1 + max|b|)``; 0 when both ran the same kernel deterministically), and
writes ``te_dpa.json`` to ``--out``, with ``te_cudnn_frontend.log`` beside it: the cuDNN graphs
TE itself built in the native run (``CUDNN_FRONTEND_LOG_INFO=1``), to put beside ours. Exit 0,
2 when TE or a GPU is missing.

**Never ran on a GPU** (written on a CPU-only machine). Its pieces are tested on CPU: the config
translation, the comparison, and :func:`run_configs` with the plugin inside TE 2.20.2 booted with
a stub extension (``tests/te/test_gpu_scripts.py``; tensors made to look like CUDA tensors at
:func:`make_input`, the one place that allocates them). The native run is not executed on CPU:
TE's native kernels (and its unfused path's ``device="cuda"`` masks) need CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from families import write_report  # noqa: E402

DPA_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
#: How many runnable configs are compared by default.
DEFAULT_CONFIGS = 12
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def runnable(limit: int = DEFAULT_CONFIGS) -> list[tuple[str, Any]]:
    """The first ``limit`` configs DotProductAttention can run with plain tensors, round-robin
    over the families so that every runnable family is represented."""
    from families import RUNNABLE, configs

    pools: dict[str, list[Any]] = {}
    for family, cfg in configs():
        simple = (cfg.is_training and not cfg.fp8 and not cfg.kv_cache and not cfg.dropout
                  and cfg.alibi_slopes_shape is None and cfg.bias_type in ("no_bias",
                                                                           "post_scale_bias")
                  and not cfg.pad_between_seqs and (cfg.qkv_format == "thd"
                                                    or "padding" not in cfg.attn_mask_type))
        if family in RUNNABLE and simple:
            pools.setdefault(family, []).append(cfg)
    out: list[tuple[str, Any]] = []
    while len(out) < limit and any(pools.values()):
        for family in list(pools):
            if pools[family] and len(out) < limit:
                out.append((family, pools[family].pop(0)))
    return out


def shapes(cfg: Any) -> dict[str, Any]:
    """Tensor shapes and DotProductAttention arguments for a config (TE's conventions)."""
    b, sq, skv = cfg.batch_size, cfg.max_seqlen_q, cfg.max_seqlen_kv
    h, hg, dqk, dv = cfg.num_heads, cfg.num_gqa_groups, cfg.head_dim_qk, cfg.head_dim_v
    fmt = cfg.qkv_format
    if fmt == "thd":
        q, k, v = (b * sq, h, dqk), (b * skv, hg, dqk), (b * skv, hg, dv)
    elif fmt == "sbhd":
        q, k, v = (sq, b, h, dqk), (skv, b, hg, dqk), (skv, b, hg, dv)
    else:
        q, k, v = (b, sq, h, dqk), (b, skv, hg, dqk), (b, skv, hg, dv)
    module = dict(num_attention_heads=h, kv_channels=(dqk, dv), num_gqa_groups=hg,
                  attention_dropout=0.0, qkv_format=fmt, attn_mask_type=cfg.attn_mask_type,
                  window_size=cfg.window_size, softmax_type=cfg.softmax_type)  # fmt: skip
    forward: dict[str, Any] = {}
    if fmt == "thd":
        forward.update(cu_seqlens_q=[i * sq for i in range(b + 1)],
                       cu_seqlens_kv=[i * skv for i in range(b + 1)], max_seqlen_q=sq,
                       max_seqlen_kv=skv)  # fmt: skip
    bias = None
    if cfg.bias_type == "post_scale_bias":
        code = cfg.bias_shape or "1hss"
        bias = (b if code[0] == "b" else 1, h if code[1] == "h" else 1,
                1 if code == "111s" else sq, skv)  # fmt: skip
        forward["core_attention_bias_type"] = "post_scale_bias"
    return {"q": q, "k": k, "v": v, "bias": bias, "module": module, "forward": forward,
            "dtype": _TORCH_DTYPES[cfg.dtype], "deterministic": cfg.deterministic}  # fmt: skip


def seeded(shape: tuple[int, ...], dtype: Any, seed: int, grad: bool = True) -> Any:
    """A seeded random CPU tensor (generated on the CPU, so both runs get the same values)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
    return t.requires_grad_(grad)


def make_input(shape: tuple[int, ...], dtype: Any, seed: int, grad: bool = True) -> Any:
    """:func:`seeded` moved to the GPU (the one place the script allocates on the device)."""
    return seeded(shape, dtype, seed, False).to("cuda").requires_grad_(grad)


make_input.__wrapped__ = seeded  # type: ignore[attr-defined]


def run_configs(cases: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Forward + backward of every case through TE's DotProductAttention in this process."""
    import torch
    import transformer_engine.pytorch as te

    dpa_mod = sys.modules[DPA_MODULE]
    results = []
    for i, (family, cfg) in enumerate(cases):
        s = shapes(cfg)
        dtype = getattr(torch, s["dtype"])
        torch.manual_seed(1234 + i)
        layer = te.DotProductAttention(**s["module"])
        q, k, v = (make_input(s[n], dtype, 10 * i + j) for j, n in enumerate(("q", "k", "v")))
        kw = dict(s["forward"])
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            if name in kw:
                kw[name] = torch.tensor(kw[name], dtype=torch.int32, device=q.device)
        if s["bias"] is not None:
            kw["core_attention_bias"] = make_input(s["bias"], dtype, 10 * i + 7, grad=False)
        row: dict[str, Any] = {"family": family, "config": cfg.to_dict()}
        try:
            out = layer(q, k, v, **kw)
            grad = make_input(tuple(out.shape), dtype, 10 * i + 9, grad=False)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
            used = dict(dpa_mod._attention_backends)
            row["backend"] = ("FlashAttention" if used.get("use_flash_attention") else
                              "FusedAttention" if used.get("use_fused_attention") else
                              "UnfusedDotProductAttention")  # fmt: skip
            row["tensors"] = {n: t.detach().float().cpu() for n, t in
                              (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a refusal is part of the comparison
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        results.append(row)
    return results


def error(a: Any, b: Any) -> float:
    """``max|a - b| / (1 + max|b|)`` (absolute near zero, relative for large values)."""
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / (1.0 + (b.abs().max().item() if b.numel() else 0.0))


def compare(plugin: list[dict[str, Any]], native: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for p, n in zip(plugin, native, strict=True):
        row = {"family": p["family"], "config": p["config"], "plugin": p.get("backend"),
               "native": n.get("backend"), "plugin_error": p.get("error"),
               "native_error": n.get("error")}  # fmt: skip
        if "tensors" in p and "tensors" in n:
            row["errors"] = {k: error(p["tensors"][k], n["tensors"][k]) for k in p["tensors"]}
        rows.append(row)
    errs = [r["errors"] for r in rows if "errors" in r]
    return {
        "configs": len(rows),
        "same_backend": sum(r["plugin"] == r["native"] and r["plugin"] is not None for r in rows),
        "max_err_out": max((e["out"] for e in errs), default=None),
        "max_err_grad": max((max(e["dq"], e["dk"], e["dv"]) for e in errs), default=None),
        "rows": rows,
    }


def _worker(mode: str, out: Path, limit: int) -> int:
    import torch

    torch.save(run_configs(runnable(limit)), out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="directory for te_dpa.json")
    ap.add_argument("--configs", type=int, default=DEFAULT_CONFIGS)
    ap.add_argument("--worker", choices=("plugin", "native"), help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.result, args.configs)
    try:
        import torch
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"te_dpa: skipped: transformer_engine.pytorch does not import here: "
              f"{type(exc).__name__}: {exc}"[:400])  # fmt: skip
        return 2
    if not torch.cuda.is_available():
        print("te_dpa: skipped: no CUDA GPU")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="te-dpa-"))
    results = {}
    for mode in ("plugin", "native"):
        env = {k: v for k, v in os.environ.items() if k != "NVTE_PLUGIN"}
        if mode == "plugin":
            env["NVTE_PLUGIN"] = "te_fl_attention"
        elif args.out:  # TE's own cuDNN graphs, as cudnn-frontend logs them (JSON per graph)
            args.out.mkdir(parents=True, exist_ok=True)
            env.update(CUDNN_FRONTEND_LOG_INFO="1",
                       CUDNN_FRONTEND_LOG_FILE=str(args.out / "te_cudnn_frontend.log"))
        path = tmp / f"{mode}.pt"
        rc = subprocess.call([sys.executable, __file__, "--worker", mode, "--result", str(path),
                              "--configs", str(args.configs)], env=env)  # fmt: skip
        if rc != 0 or not path.exists():
            print(f"te_dpa: the {mode} run failed (exit {rc})")
            return 2
        results[mode] = torch.load(path, weights_only=False)
    report = compare(results["plugin"], results["native"])
    for r in report["rows"]:
        e = r.get("errors") or {}
        errs = " ".join(f"{k}={v:.3g}" for k, v in e.items()) or \
            f"error={r['plugin_error'] or r['native_error']}"  # fmt: skip
        print(f"te_dpa family={r['family']} plugin={r['plugin']} native={r['native']} {errs}")
    print(f"te_dpa configs={report['configs']} same_backend={report['same_backend']} "
          f"max_err_out={report['max_err_out']} max_err_grad={report['max_err_grad']}")
    write_report(args.out, "te_dpa", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
