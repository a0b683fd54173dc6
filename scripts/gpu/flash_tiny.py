"""A flash-attn tiny run for every flash-attn flavour installed here (FA2, FA3, FA4).

For each installed flavour, the flash probe's own import and tiny-run stage runs on a few configs
of the local GPU (causal bf16, GQA, MLA 192/128, thd, a sliding window), exactly as a selection
would; each config's verdict and, for a refusal, its reason are printed, then::

    flash_tiny fa2=3/5 fa3=none fa4=none

(``ran/asked`` per flavour, ``none`` when not installed) and ``flash_tiny.json`` is written to
``--out``. Exit 0 when at least one flavour ran and none failed, 2 when no flavour is installed
(or no GPU), 1 when a tiny run failed. **Never ran on a GPU**; its CPU test runs it through the
test suite's hardware seam with the flash-attn 2.8.3 test double.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(ROOT)]

from families import write_report  # noqa: E402

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("causal", dict(batch_size=2, max_seqlen_q=256, num_heads=16, head_dim_qk=128,
                    attn_mask_type="causal")),
    ("gqa", dict(batch_size=2, max_seqlen_q=256, num_heads=32, num_gqa_groups=8, head_dim_qk=128,
                 attn_mask_type="causal", qkv_layout="sbhd_sbhd_sbhd")),
    ("mla", dict(batch_size=1, max_seqlen_q=256, num_heads=16, head_dim_qk=192, head_dim_v=128,
                 attn_mask_type="causal")),
    ("thd", dict(batch_size=2, max_seqlen_q=256, num_heads=16, head_dim_qk=128,
                 attn_mask_type="padding_causal", qkv_layout="thd_thd_thd")),
    ("window", dict(batch_size=1, max_seqlen_q=512, num_heads=8, head_dim_qk=64,
                    attn_mask_type="causal", window_size=(128, 0))),
]  # fmt: skip


def run() -> dict[str, Any]:
    from te_fl_attention.config import FusedAttnConfig
    from te_fl_attention.device import local
    from te_fl_attention.probes.flash.probe import FlashAttnProbe

    device = local()
    probe = FlashAttnProbe()
    flavours: dict[str, Any] = {}
    for name, kw in CONFIGS:
        result = probe.probe(FusedAttnConfig(**kw), device)
        for v in result.variants:
            entry = flavours.setdefault(v.backend, {"installed": v.detail.get("version")
                                                    is not None, "rows": []})  # fmt: skip
            entry["rows"].append({
                "config": name, "supported": v.supported, "stage": v.stage,
                "evidence": v.evidence, "reasons": [f"{r.code}: {r.message}"[:300]
                                                    for r in v.reasons],
            })  # fmt: skip
    return {"device": device.name, "sm": device.sm, "flavours": flavours}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="directory for flash_tiny.json")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flash_tiny: skipped: no CUDA GPU")
        return 2
    result = run()
    parts, ran_any, failed = [], False, False
    for flavour in ("fa2", "fa3", "fa4"):
        entry = result["flavours"].get(flavour, {"installed": False, "rows": []})
        if not entry["installed"]:
            parts.append(f"{flavour}=none")
            continue
        ran = [r for r in entry["rows"] if r["supported"] and r["stage"] == "run"]
        for r in entry["rows"]:
            print(f"{flavour} {r['config']}: {'ran' if r in ran else 'refused'} at {r['stage']}"
                  + ("" if r in ran else f" ({'; '.join(r['reasons'])[:300]})"))
            failed |= any(x.split(":")[0].endswith("run_failed") for x in r["reasons"])
        ran_any |= bool(ran)
        parts.append(f"{flavour}={len(ran)}/{len(entry['rows'])}")
    print("flash_tiny " + " ".join(parts))
    write_report(args.out, "flash_tiny", result)
    if failed:
        return 1
    return 0 if ran_any else 2


if __name__ == "__main__":
    sys.exit(main())
