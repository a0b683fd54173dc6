"""Context parallelism as TE 2.20.2 asks cuDNN about it: one query per per-step config.

TE's ``get_attention_backend`` (dot_product_attention/utils.py) calls its C++ query
(``nvte_get_fused_attn_backend_v2``) once per entry of ``cp_per_step_configs``
(context_parallel.py) and disables FusedAttention at the first step it refuses. Each step swaps
the mask, the sequence lengths, the token counts, the heads, the window and the diagonal into the
global query; a bias keeps its batch and heads and takes the step's s_q / s_kv wherever its own is
not 1. :func:`cp_steps` states those steps as plain (non-CP) :class:`FusedAttnConfig` values, so
TE's derived graph (:func:`.mapping.derive`), the graph builder and the support table see exactly
what each step's query sees. TE's code is paraphrased, never copied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ...config import FusedAttnConfig

#: ``cp_size_a2a`` (the a2a subgroup of ``a2a+p2p``) is not a config field: assumed 2 (an even
#: cp_size), else 1.
A2A_P2P_GROUP = 2


@dataclass(frozen=True)
class CPStep:
    """One context-parallel step: ``label`` (TE's comment for it: ``heads`` for a2a, ``chunk`` /
    ``full`` for all_gather, ``ring`` for a non-causal p2p step, ``diagonal`` / ``lower`` /
    ``upper`` for causal p2p), ``config`` (the step as a plain config) and ``params`` (what the
    step changes, for the detail)."""

    label: str
    config: FusedAttnConfig | None
    params: dict[str, Any]
    notes: tuple[str, ...] = ()
    #: Why the step is no valid config (e.g. s_q // (2 cp) = 0: TE requires every sequence
    #: length to be a multiple of 2 * cp_size, and passes such a step to its C++ unchecked).
    error: str | None = None

    def describe(self) -> str:
        p = self.params
        return (f"context-parallel step {self.label} ({p['attn_mask_type']}, "
                f"s_q={p['max_seqlen_q']}, s_kv={p['max_seqlen_kv']}, h={p['num_heads']})")

    def to_dict(self) -> dict[str, Any]:
        out = {"label": self.label, **self.params, "notes": list(self.notes)}
        if self.error is not None:
            out["error"] = self.error
        return out


def _step(c: FusedAttnConfig, label: str, mask: str, s_q: int, s_kv: int, heads: int, gqa: int,
          brd: bool | None, t_q: int | None, t_kv: int | None,
          window: tuple[int, int] | None = None, notes: tuple[str, ...] = ()
          ) -> CPStep:  # fmt: skip
    win = tuple(c.window_size) if window is None else window  # type: ignore[arg-type]
    params = {"attn_mask_type": mask, "max_seqlen_q": s_q, "max_seqlen_kv": s_kv,
              "num_heads": heads, "num_gqa_groups": gqa, "window_size": list(win),
              "bottom_right_diagonal": brd, "num_tokens_q": t_q, "num_tokens_kv": t_kv}
    try:
        cfg = c.replace(context_parallel=False, cp_size=1, cp_comm_type="p2p",
                        attn_mask_type=mask, max_seqlen_q=s_q, max_seqlen_kv=s_kv,
                        num_heads=heads, num_gqa_groups=gqa, window_size=win,
                        bottom_right_diagonal=brd, num_tokens_q=t_q,
                        num_tokens_kv=t_kv)  # fmt: skip
    except ValueError as exc:
        return CPStep(label, None, params, notes, error=str(exc))
    return CPStep(label, cfg, params, notes)


def _scale(tokens: int | None, mul: int = 1, div: int = 1) -> int | None:
    return None if tokens is None else tokens * mul // div


def cp_steps(c: FusedAttnConfig) -> tuple[CPStep, ...]:
    """TE 2.20.2's ``cp_per_step_configs`` for ``c``: empty without context parallelism (read
    from the field: every table rule asks, and a config is not hashed for it), else
    :func:`_cp_steps`, once per config."""
    return _cp_steps(c) if c.context_parallel else ()


@functools.lru_cache(maxsize=512)
def _cp_steps(c: FusedAttnConfig) -> tuple[CPStep, ...]:
    """The per-step configs of a context-parallel ``c`` (TE's ``cp_per_step_configs``).

    a2a: one step, heads and GQA groups divided by cp_size, token counts times cp_size. all_gather:
    s_q / (2 cp) against the one-chunk s_kv / (2 cp) and the full s_kv, a top-left causal mask
    turned bottom-right, the KV tokens times cp_size. p2p (a2a+p2p: heads divided by the a2a
    group, the ring over cp / a2a): s / p2p_size; a causal mask adds the lower-triangle step
    (s_kv and kv tokens halved) and the upper-triangle step (s_q and q tokens halved), both with
    the mask's padding part only and no window. The config keeps thd token counts bucketed (TE's
    C++ buckets the raw count, ``get_max_tokens``): a step scales the bucket, which is the bucket
    of the scaled raw count up to 32768 tokens; above, the multiple-of-32768 buckets may differ
    by one step (noted)."""
    ct, cp, m = c.cp_comm_type, c.cp_size, c.attn_mask_type
    assert c.max_seqlen_kv is not None and c.num_gqa_groups is not None
    sq, skv, h, hg = c.max_seqlen_q, c.max_seqlen_kv, c.num_heads, c.num_gqa_groups
    tq, tkv, brd = c.num_tokens_q, c.num_tokens_kv, c.bottom_right_diagonal
    causal = "causal" in m
    notes: tuple[str, ...] = ()
    if any(t is not None and t > 32768 for t in (tq, tkv)):
        notes = ("thd token counts are kept bucketed: a step's scaled count is the scaled bucket",)
    if ct == "a2a":
        return (_step(c, "heads", m, sq, skv, h // cp, hg // cp, brd, _scale(tq, cp),
                      _scale(tkv, cp), notes=notes),)  # fmt: skip
    if ct == "all_gather":
        s_q, chunk = sq // (2 * cp), skv // (2 * cp)
        mask, br = m, brd
        if causal and "bottom_right" not in m:
            mask, br = m + "_bottom_right", True
        kvs = (("chunk", chunk), ("full", skv)) if chunk != skv else (("full", skv),)
        return tuple(_step(c, label, mask, s_q, s_kv, h, hg, br, tq, _scale(tkv, cp),
                           notes=notes) for label, s_kv in kvs)  # fmt: skip
    a2a = A2A_P2P_GROUP if ct == "a2a+p2p" and cp % A2A_P2P_GROUP == 0 else 1
    if ct == "a2a+p2p":
        notes = (*notes, f"a2a+p2p: cp_size_a2a={a2a} assumed (TE's AttentionParams carries it, "
                 "the config does not)")
    p2p, heads, gqa = cp // a2a, h // a2a, hg // a2a
    r_q, r_kv = sq // p2p, skv // p2p
    if not causal:
        return (_step(c, "ring", m, r_q, r_kv, heads, gqa, brd, tq, tkv, notes=notes),)
    plain = "padding" if "padding" in m else "no_mask"
    return (
        _step(c, "diagonal", m, r_q, r_kv, heads, gqa, brd, tq, tkv, notes=notes),
        _step(c, "lower", plain, r_q, r_kv // 2, heads, gqa, brd, tq, _scale(tkv, 1, 2),
              window=(-1, -1), notes=notes),
        _step(c, "upper", plain, r_q // 2, r_kv, heads, gqa, brd, _scale(tq, 1, 2), tkv,
              window=(-1, -1), notes=notes),
    )


__all__ = ["A2A_P2P_GROUP", "CPStep", "cp_steps"]
