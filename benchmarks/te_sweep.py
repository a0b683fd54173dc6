"""A seeded random sweep: TE 2.20.2's ``get_attention_backend`` and ours, cuDNN graphs both sides.

``--n`` random attention configurations (``--seed``), each a valid ``DotProductAttention`` call
as TE's ``AttentionParams`` (edge head dims, MLA, GQA/MQA, sliding windows, every bias shape,
ALiBi with and without custom slopes, the three softmax types, thd with TE's token counts
(decode s_q = 1, s_q = s_kv = 1), every mask, dropout, training / inference, determinism,
context parallelism (p2p / all_gather / a2a / a2a+p2p, cp_size 2 or 4), KV caches, FP8 DPA
recipes (``--fp8``), and a few softcap / arbitrary-mask / CUDA-graph / checkpointed calls), x the
catalog GPUs (``--device``, default a100 h100 b200), through

* TE 2.20.2's own ``get_attention_backend`` on CPU (``tests/probes/te_cpu.py``: compute
  capability, cuDNN and flash-attn patched to the profile), whose C++ cuDNN query
  ``tex.get_fused_attn_backend`` first refuses what TE's C++ refuses before building a graph
  (``te_cpu.cpp_prechecks``) and is otherwise answered by cuDNN itself: the deviceless graph
  build of the ``FusedAttentionParams`` TE hands its C++ (``stub_tex.GraphFusedBackend``: after
  TE's ALiBi -> post_scale_bias rewrite, with TE's thd token counts, one query per
  context-parallel step), and
* our plugin's ``get_attention_backend`` with graph probes (``Selector(default_probes(
  graph=True))``, the deviceless cuDNN graph builds of our fused probe), with TE's default
  policy and our Triton candidate off (``TE_FL_ATTN_TRITON=0``: TE has none).

A row (config x device) agrees when all six fields of the two tuples agree (flash / fused /
unfused availability, flash-attn version, fused sub-backend, selected backend). Prints::

    te_sweep configs=N rows=M agree=P% (elapsed S s, G graph builds B s, H memo hits)

how each side's fused verdict was reached (TE's C++ pre-graph refusal or cuDNN's graph; our
rules or cuDNN's graph), then the disagreement families (the differing fields, both values and
both sides' first reason, numbers elided), largest first, with a count and one example each.
Identical graph queries are memoized (both sides' probe workers go through one memo per
process); ``--jobs`` shards the rows over processes by device.

    python benchmarks/te_sweep.py [--seed 0] [--n 4000] [--device a100 ...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import copy
import dataclasses
import json
import multiprocessing
import random
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests" / "probes", ROOT / "tests" / "te", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import te_replay  # noqa: E402

DEVICES = ("a100", "h100", "b200")
FIELDS = te_replay.FIELDS

# ---------------------------------------------------------------------------- the configs
#: (d_qk, d_v), weighted by repetition: common dims, edge dims, MLA and > 256.
HEAD_DIMS = ((64, 64),) * 4 + ((128, 128),) * 4 + (
    (32, 32), (72, 72), (80, 80), (96, 96), (160, 160), (192, 192), (256, 256), (256, 256),
    (320, 320), (512, 512), (192, 128), (192, 128), (128, 64), (96, 64), (576, 512), (64, 128),
    (8, 8), (48, 48), (100, 100), (136, 136), (264, 264),
)  # fmt: skip
SEQLENS = (64, 77, 128, 128, 256, 333, 512, 512, 1000, 1024, 2048, 4096, 8192)
BATCHES = (1, 2, 2, 4, 8, 16, 48)
HEADS = (8, 16, 16, 32)
BIAS_SHAPES = ("1hss", "b1ss", "bhss", "11ss", "111s")
CP_COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")
SOFTMAX = ("vanilla", "vanilla", "vanilla", "off-by-one", "learnable")
#: TE recipe classes (``transformer_engine.common.recipe``) an FP8 draw uses, weighted.
FP8_RECIPES = ("DelayedScaling", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")
FP8_SHARE = 0.08


class Invalid(Exception):
    """A draw that is no valid DotProductAttention call (redrawn)."""


@dataclasses.dataclass(frozen=True)
class Draw:
    """One sweep config: the ``AttentionParams`` fields (JSON-able: ``qkv_dtype`` as "fp16" /
    "bf16"; ``kv_cache`` None, "paged" or "non-paged" stands for ``inference_params``)."""

    index: int
    params: dict[str, Any]
    kv_cache: str | None = None

    @property
    def name(self) -> str:
        p = self.params
        bits = [f"#{self.index}", p["qkv_dtype"], p["qkv_layout"],
                f"b={p['batch_size']} h={p['num_heads']}/{p['num_gqa_groups']}",
                f"s={p['max_seqlen_q']}/{p['max_seqlen_kv']}",
                f"d={p['head_dim_qk']}/{p['head_dim_v']}", p["attn_mask_type"]]  # fmt: skip
        if p["num_tokens_q"] or p["num_tokens_kv"]:
            bits.append(f"t={p['num_tokens_q']}/{p['num_tokens_kv']}")
        if tuple(p["window_size"]) not in ((-1, -1), (-1, 0)):
            bits.append(f"window={tuple(p['window_size'])}")
        if p["core_attention_bias_type"] != "no_bias":
            extra = p["core_attention_bias_shape"] or p["alibi_slopes_shape"]
            bits.append(f"{p['core_attention_bias_type']}{list(extra) if extra else ''}"
                        + (" grad" if p["core_attention_bias_requires_grad"] else ""))
        if p["softmax_type"] != "vanilla":
            bits.append(p["softmax_type"])
        if p["attention_dropout"]:
            bits.append(f"dropout={p['attention_dropout']}")
        if p["context_parallel"]:
            bits.append(f"cp={p['cp_comm_type']}x{p['cp_size']}")
        if p.get("fp8"):
            bits.append(f"fp8={p['fp8_recipe']}" + (" fp8_mha" if p["fp8_mha"] else ""))
        if p["softcap"]:
            bits.append(f"softcap={p['softcap']}")
        for flag in ("deterministic", "pad_between_seqs", "return_max_logit", "cuda_graph",
                     "checkpoint_core_attention"):  # fmt: skip
            if p[flag]:
                bits.append(flag)
        if self.kv_cache:
            bits.append(f"kv_cache={self.kv_cache}")
        bits.append("train" if p["is_training"] else "inference")
        return " ".join(str(b) for b in bits)


def features(d: Draw) -> list[str]:
    """The draw's tags for the coverage line (each row counts once per tag)."""
    p = d.params
    tags = []
    dqk, dv = p["head_dim_qk"], p["head_dim_v"]
    tags.append("mla" if dqk != dv else f"d{dqk}" if dqk in (72, 96, 160, 192, 256) else
                "d>256" if dqk > 256 else "d_other")  # fmt: skip
    h, hg = p["num_heads"], p["num_gqa_groups"]
    tags.append("mha" if h == hg else "mqa" if hg == 1 else "gqa")
    fmt = p["qkv_layout"].replace("paged_kv_", "").split("_")[0]
    fmt = "".join(ch for ch in fmt if ch.isalpha())
    tags.append(fmt)
    if fmt == "thd" and p["max_seqlen_q"] == 1:
        tags.append("thd_sq1" if p["max_seqlen_kv"] > 1 else "thd_sq1_skv1")
    tags.append(p["attn_mask_type"])
    if tuple(p["window_size"]) not in ((-1, -1), (-1, 0)):
        tags.append("swa")
    bt = p["core_attention_bias_type"]
    if bt == "alibi":
        tags.append("alibi_slopes" if p["alibi_slopes_shape"] else "alibi")
    elif bt != "no_bias":
        b, hh, sq, _ = p["core_attention_bias_shape"]
        code = ("b" if b != 1 else "1") + ("h" if hh != 1 else "1") + ("s" if sq != 1 else "1")
        tags.append(f"{bt.split('_')[0]}_{code}s")
    tags.append(p["softmax_type"])
    if p["attention_dropout"]:
        tags.append("dropout")
    tags.append("train" if p["is_training"] else "inference")
    if p["deterministic"]:
        tags.append("deterministic")
    if p["context_parallel"]:
        tags.append(f"cp_{p['cp_comm_type']}x{p['cp_size']}")
    if p.get("fp8"):
        tags.append(f"fp8_{p['fp8_recipe']}")
    if d.kv_cache:
        tags.append(f"kv_{d.kv_cache}")
    tags.append(p["qkv_dtype"])
    return tags


def _window(rng: random.Random, mask: str, sq: int, skv: int) -> tuple[int, int]:
    if rng.random() >= 0.25:
        return (-1, 0) if "causal" in mask else (-1, -1)
    left = rng.choice((0, 16, 64, 128, 512, 1024, max(skv // 2, 1)))
    if "causal" in mask:
        return (left, 0)
    return (left, rng.choice((0, left, 32)))


def _bias(rng: random.Random, p: dict[str, Any]) -> None:
    b, h, sq, skv = (p[k] for k in ("batch_size", "num_heads", "max_seqlen_q", "max_seqlen_kv"))
    p.update(core_attention_bias_type="no_bias", core_attention_bias_shape=None,
             core_attention_bias_requires_grad=False, alibi_slopes_shape=None)  # fmt: skip
    r = rng.random()
    if r < 0.6:
        return
    if r < 0.85:
        code = rng.choice(BIAS_SHAPES)
        shape = {"bhss": (b, h, sq, skv), "1hss": (1, h, sq, skv), "b1ss": (b, 1, sq, skv),
                 "11ss": (1, 1, sq, skv), "111s": (1, 1, 1, skv)}[code]  # fmt: skip
        p.update(core_attention_bias_type="post_scale_bias", core_attention_bias_shape=shape,
                 core_attention_bias_requires_grad=p["is_training"] and rng.random() < 0.5)
        return
    if r < 0.88:
        p.update(core_attention_bias_type="pre_scale_bias",
                 core_attention_bias_shape=(1, h, sq, skv))  # fmt: skip
        return
    slopes = rng.choice((None, None, [h], [b, h]))
    p.update(core_attention_bias_type="alibi", alibi_slopes_shape=slopes)


def _layout(rng: random.Random, fmt: str, p: dict[str, Any]) -> str:
    same_s = p["max_seqlen_q"] == p["max_seqlen_kv"]
    mha = p["num_heads"] == p["num_gqa_groups"]
    same_d = p["head_dim_qk"] == p["head_dim_v"]
    t = fmt[0]  # b, s or t
    three = {"b": ("bs3hd", "bsh3d"), "s": ("sb3hd", "sbh3d"), "t": ("t3hd", "th3d")}[t]
    two = {"b": ("bshd_bs2hd", "bshd_bsh2d"), "s": ("sbhd_sb2hd", "sbhd_sbh2d"),
           "t": ("thd_t2hd", "thd_th2d")}[t]  # fmt: skip
    sep = f"{fmt}_{fmt}_{fmt}"
    options = [sep, sep]
    if same_d:
        options += list(two)
        if same_s and mha:
            options += list(three)
    return rng.choice(options)


def draw(rng: random.Random, index: int, fp8: float = FP8_SHARE) -> Draw:
    """One random valid config (raises :class:`Invalid` for a draw TE would not accept)."""
    dqk, dv = rng.choice(HEAD_DIMS)
    h = rng.choice(HEADS)
    hg = rng.choice((h, h, h // 4, 1))
    b = rng.choice(BATCHES)
    sq = rng.choice(SEQLENS)
    skv = sq if rng.random() < 0.55 else rng.choice(SEQLENS)
    decode = rng.random()
    if decode < 0.08:
        sq = 1
    elif decode < 0.11:
        sq = skv = 1
    kv_cache = None
    if rng.random() < 0.06:
        kv_cache = rng.choice(("paged", "non-paged"))
    fmt = rng.choices(("bshd", "sbhd", "thd"), weights=(4, 3, 3))[0]
    training = rng.random() < 0.65 and kv_cache is None
    mask = rng.choice(("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                       "padding_causal_bottom_right"))  # fmt: skip
    if rng.random() < 0.03 and fmt != "thd" and kv_cache is None:
        mask = "arbitrary"  # a user-supplied mask tensor
    if (fmt == "thd" or kv_cache) and "padding" not in mask:
        mask = "padding" if mask == "no_mask" else f"padding_{mask}"
    comm, cp_size, cp_a2a = None, 1, 1
    if rng.random() < 0.15 and kv_cache is None and sq > 1:
        comm = rng.choice(CP_COMMS)
        cp_size = 4 if comm == "a2a+p2p" else rng.choice((2, 4))
        cp_a2a = 2 if comm == "a2a+p2p" else 1
        heads_div = cp_size if comm == "a2a" else cp_a2a
        if h % heads_div or hg % heads_div:
            raise Invalid("a2a splits the heads over the ranks")
        if sq % (2 * cp_size) or skv % (2 * cp_size):
            raise Invalid("context parallelism splits each sequence in 2 * cp_size chunks")
    p: dict[str, Any] = dict(
        qkv_dtype=rng.choice(("fp16", "bf16")), batch_size=b, num_heads=h, num_gqa_groups=hg,
        max_seqlen_q=sq, max_seqlen_kv=skv, head_dim_qk=dqk, head_dim_v=dv,
        attn_mask_type=mask, is_training=training,
        attention_dropout=rng.choice((0.0, 0.0, 0.0, 0.1)),
        softmax_type=rng.choice(SOFTMAX), deterministic=rng.random() < 0.2,
        context_parallel=comm is not None, cp_comm_type=comm or "p2p", cp_size=cp_size,
        cp_size_a2a=cp_a2a, return_max_logit=rng.random() < 0.05, num_splits=1,
        softmax_scale=dqk ** -0.5, pad_between_seqs=False, num_tokens_q=0, num_tokens_kv=0,
        softcap=30.0 if rng.random() < 0.03 else 0.0, cuda_graph=rng.random() < 0.03,
        checkpoint_core_attention=training and rng.random() < 0.05,
    )  # fmt: skip
    _bias(rng, p)
    p.update(fp8=False, fp8_recipe=None, fp8_mha=False)
    if rng.random() < fp8:  # FP8 DPA: an fp8_autocast recipe with fp8_dpa (q/k/v stay 16-bit)
        p.update(fp8=True, fp8_recipe=rng.choice(FP8_RECIPES), fp8_mha=rng.random() < 0.2)
    if kv_cache:
        q_fmt = rng.choice(("bshd", "sbhd", "thd"))
        kv_fmt = rng.choice(("bshd", "sbhd"))
        layout = f"{q_fmt}_{kv_fmt}_{kv_fmt}"
        if kv_cache == "paged":
            layout = "paged_kv_" + layout
        fmt = q_fmt
    if fmt == "thd":
        # q.shape[0] / k.shape[0]: the packed tokens (every sequence full, or fewer)
        full_q, full_kv = b * sq, b * skv
        p["num_tokens_q"] = full_q if rng.random() < 0.5 else rng.randint(b, full_q)
        if not kv_cache:
            p["num_tokens_kv"] = full_kv if rng.random() < 0.5 else rng.randint(b, full_kv)
        p["pad_between_seqs"] = rng.random() < 0.3
    if not kv_cache:
        layout = _layout(rng, fmt, p)
        if "3" in layout:
            p["num_tokens_kv"] = p["num_tokens_q"]
    p["qkv_layout"] = layout
    window = _window(rng, mask, sq, skv)
    p["window_size"] = list(window)
    p["bottom_right_diagonal"] = rng.choice((None, True, False))
    return Draw(index, p, kv_cache)


def draws(seed: int, n: int, fp8: float = FP8_SHARE) -> list[Draw]:
    """``n`` valid random configs from ``seed`` (invalid draws are redrawn); ``fp8``: the
    share of FP8 DPA draws."""
    rng = random.Random(seed)
    out: list[Draw] = []
    while len(out) < n:
        try:
            out.append(draw(rng, len(out), fp8))
        except Invalid:
            continue
    return out


def attention_params(te: Any, d: Draw) -> Any:
    """TE's ``AttentionParams`` for a draw, as ``DotProductAttention.forward`` builds them:
    ``check_set_window_size``, the diagonal from the mask, KV caching's bottom-right causal
    mask, the bias tensor's shape, the alibi slopes' shape."""
    import torch

    p = dict(d.params)
    utils = te.utils
    mask = p.pop("attn_mask_type")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        window = utils.check_set_window_size(mask, tuple(p.pop("window_size")))
    brd = p.pop("bottom_right_diagonal")
    inference = None
    if d.kv_cache == "paged":
        pages = -(-p["max_seqlen_kv"] // 16)
        inference = te_replay._InferenceParams(True, 16, pages * p["batch_size"],
                                               te_replay._CacheManager(pages))  # fmt: skip
    elif d.kv_cache:
        inference = te_replay._InferenceParams(False, None, None, None)
    if inference is not None and mask == "padding_causal":
        mask, brd = "padding_causal_bottom_right", True
    if mask in ("causal", "padding_causal"):
        brd = False
    if brd is None or mask in ("causal_bottom_right", "padding_causal_bottom_right"):
        brd = True
    shape = p.pop("core_attention_bias_shape")
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[p.pop("qkv_dtype")])
    recipe_name, fp8_mha = p.pop("fp8_recipe", None), p.pop("fp8_mha", False)
    qkv_type: Any = torch.Tensor
    fp8_meta = None
    if p.get("fp8"):
        recipe = getattr(te.recipe, recipe_name)()
        recipe.fp8_dpa, recipe.fp8_mha = True, fp8_mha
        fp8_meta = {"recipe": recipe}
        if fp8_mha and recipe_name in ("DelayedScaling", "Float8CurrentScaling"):
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

            qkv_type = Float8Tensor  # its .dtype is the 16-bit nominal dtype
    return utils.AttentionParams(
        qkv_type=qkv_type, qkv_dtype=dtype, attn_mask_type=mask, window_size=window,
        bottom_right_diagonal=brd, inference_params=inference, fp8_meta=fp8_meta,
        core_attention_bias_shape=tuple(shape) if shape else None, **p)  # fmt: skip


# ---------------------------------------------------------------------------- the two sides
class MemoWorker:
    """A probe worker with a memo: identical graph queries (config, descriptor, sm, options)
    are built once per process. Both sides' queries go through it."""

    def __init__(self, worker: Any = None) -> None:
        self.worker = worker
        self.memo: dict[str, dict[str, Any]] = {}
        self.builds = self.hits = 0
        self.build_s = 0.0

    def probe(self, config_dict: Any, device_descriptor: Any, sm: int | None = None,
              timeout_s: float = 60.0, **kw: Any) -> dict[str, Any]:  # fmt: skip
        options = {k: v for k, v in kw.items() if v}  # False / None: the worker's defaults
        key = json.dumps([config_dict, device_descriptor, sm, options], sort_keys=True,
                         default=str)  # fmt: skip
        hit = self.memo.get(key)
        if hit is None:
            if self.worker is None:
                from te_fl_attention.probes.fused.worker import CudnnWorker

                self.worker = CudnnWorker()
            t0 = time.perf_counter()
            hit = self.worker.probe(config_dict, device_descriptor, sm, timeout_s, **kw)
            self.build_s += time.perf_counter() - t0
            self.builds += 1
            if hit.get("decided") or hit.get("code") == "cudnn.unsupported_by_probe":
                self.memo[key] = hit  # worker deaths / timeouts are asked again
        else:
            self.hits += 1
        return copy.deepcopy(hit)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class Sweep(te_replay.Replay):
    """te_replay's two sides, with cuDNN graphs: TE's C++ query answered by the graph build of
    what TE passes it, ours with graph probes; one :class:`MemoWorker` under both."""

    def __init__(self, te_query: str = "graph") -> None:
        """``te_query="table"``: TE's C++ query answered by our support table instead (as in
        te_replay), to measure the table's predictions against cuDNN's graphs on our side."""
        super().__init__()
        import stub_tex

        from te_fl_attention.probes import default_probes
        from te_fl_attention.probes.fused import worker as worker_mod
        from te_fl_attention.selector import Selector

        self.memo = MemoWorker()
        self._worker_mod = worker_mod
        self.graph = stub_tex.GraphFusedBackend(worker=self.memo)
        if te_query == "table":
            self.graph = stub_tex.table_fused_backend  # type: ignore[assignment]
        elif te_query != "graph":
            raise ValueError(f"te_query: 'graph' or 'table', got {te_query!r}")
        self.selector = Selector(default_probes(graph=True))
        self.backends = {}
        #: how the TE side's C++ queries and our fused verdicts were answered
        self.sources: collections.Counter = collections.Counter()

    def cpp_query(self, params: Any, device: Any) -> tuple[int, str]:
        from te_fl_attention.probes.base import cudnn_version

        refused = self.prechecks(params, device.sm, cudnn_version(device) or (0, 0, 0))
        if refused is not None:
            self.sources["TE query: C++ pre-graph refusal"] += 1
            return -1, refused[1]
        answer = self.graph(params, device)
        self.sources["TE query: cuDNN graph " + ("refused" if answer[0] < 0 else "ok")] += 1
        return answer

    def close(self) -> None:
        self.memo.close()

    def run(self, case: Draw, device_name: str) -> te_replay.Outcome:  # type: ignore[override]
        from te_fl_attention.device import profile

        device = profile(device_name)
        backend = self.backends.get(device_name) or self.backends.setdefault(
            device_name, self._make(device))
        tex = self.te.te.tex
        saved = tex.get_fused_attn_backend
        tex.get_fused_attn_backend = lambda params: self.cpp_query(params, device)
        ours_env = {k: None for k in self.env_vars} | {"TE_FL_ATTN_TRITON": "0"}
        ours_error = None
        # our fused probe asks get_worker(None) for its (deviceless) worker: the memo answers
        saved_get_worker = self._worker_mod.get_worker
        self._worker_mod.get_worker = lambda device=None: self.memo
        try:
            with self.te.device(device), self.te._captured_log(self.debug) as lines, \
                    warnings.catch_warnings(), te_replay._env(**ours_env):  # fmt: skip
                warnings.simplefilter("ignore")
                params = attention_params(self.te.te, case)
                te_answer = self.te.te.utils.get_attention_backend(params)
                try:
                    ours = backend(params)
                    decision = backend.decide(params)
                except Exception as exc:  # noqa: BLE001 - a disagreement, not a crash
                    ours_error = f"{type(exc).__name__}: {exc}"
        finally:
            tex.get_fused_attn_backend = saved
            self._worker_mod.get_worker = saved_get_worker
        reasons: dict[str, tuple[str, ...]] = {}
        if ours_error is None:
            for r in decision.results:
                codes = [f"{x.code}: {x.message}" for x in r.reasons]
                codes += [f"{v.backend} {x.code}: {x.message}" for v in r.variants
                          for x in v.reasons]  # fmt: skip
                reasons[r.backend] = tuple(codes)
            ours_fields = te_replay._as_fields(ours)
            fused = next((r for r in decision.results if r.backend == "fused"), None)
            if fused is not None:
                how = "cuDNN graph" if str(fused.evidence).startswith("cudnn") else "rules"
                self.sources[f"ours fused: {how}"] += 1
        else:
            reasons = {"error": (ours_error,)}
            ours_fields = {f: "error" for f in FIELDS}
        log = tuple(x for x in lines if "isabling" in x or "Selected" in x)
        return te_replay.Outcome(case, te_replay._as_fields(te_answer), ours_fields, log,
                                 reasons)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- families
_NUM = re.compile(r"\d+(\.\d+)?")


_TE_MARKER = {"flash": "Disabling FlashAttention", "fused": "Disabling FusedAttention",
              "unfused": "Disabling UnfusedDotProductAttention"}  # fmt: skip


def _short(text: str, limit: int = 110) -> str:
    text = _NUM.sub("N", text.split("\n", 1)[0]).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _backend_of(field: str, diffs: list[str]) -> str:
    """The backend a field is about (``selected``: the first availability that differs)."""
    if field == "selected":
        return next((x for x in ("fused", "flash", "unfused") if x in diffs), "fused")
    return {"flash_version": "flash", "fused_sub_backend": "fused"}.get(field, field)


def why(row: dict[str, Any], side: str, backend: str) -> str:
    """One side's reason about ``backend`` in a row: its first refusal, or "accepted"."""
    if side == "ours" and "error" in row["our_reasons"]:
        return row["our_reasons"]["error"][0]
    if row[side][backend] is True:
        return "accepted"
    if side == "te":
        return next((x for x in row["te_log"] if x.startswith(_TE_MARKER[backend])), "")
    return next(iter(row["our_reasons"].get(backend, ())), "")


def family(row: dict[str, Any]) -> str:
    """A disagreement's family: the differing fields, both values of the first, and both
    sides' reason about its backend (numbers elided)."""
    diffs = row["diffs"]
    f = diffs[0]
    backend = _backend_of(f, diffs)
    return (f"[{','.join(diffs)}] TE {f}={row['te'][f]!r} ours {f}={row['ours'][f]!r} | "
            f"{backend}: TE {_short(why(row, 'te', backend))} | "
            f"ours {_short(why(row, 'ours', backend))}")  # fmt: skip


# ---------------------------------------------------------------------------- running
_SWEEP: Sweep | None = None


def _init(te_query: str = "graph") -> None:
    """A pool process's :class:`Sweep` (closed at exit)."""
    import atexit

    global _SWEEP
    _SWEEP = Sweep(te_query)
    atexit.register(_SWEEP.close)


def _run_rows(cases: list[Draw], devices: tuple[str, ...], runner: Sweep | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """Every (draw, device) row through ``runner`` (default: this pool process's): the rows
    that disagree (as plain data), the count, the memo's stats, how each side was answered."""
    runner = runner or _SWEEP
    assert runner is not None
    bad: list[dict[str, Any]] = []
    selected: collections.Counter = collections.Counter()
    coverage: collections.Counter = collections.Counter()
    rows = 0
    for device in devices:
        for case in cases:
            o = runner.run(case, device)
            rows += 1
            selected[(device, o.te["selected"])] += 1
            for tag in features(case):
                coverage[tag] += 1
                coverage[f"{tag}+fused"] += bool(o.te["fused"])
            diffs = o.diffs()
            if diffs:
                bad.append(dict(index=case.index, device=device, name=case.name, diffs=diffs,
                                te=o.te, ours=o.ours, te_log=list(o.te_log),
                                our_reasons={k: list(v) for k, v in o.our_reasons.items()}))
    m = runner.memo
    return dict(rows=rows, bad=bad, builds=m.builds, hits=m.hits, build_s=m.build_s,
                undecided=dict(getattr(runner.graph, "undecided", {})),
                selected=dict(selected), sources=dict(runner.sources),
                coverage=dict(coverage))  # fmt: skip


def _shards(devices: tuple[str, ...], jobs: int) -> list[tuple[str, ...]]:
    """Devices split over ``jobs`` processes (a graph is per device: the memo stays local)."""
    jobs = max(1, min(jobs, len(devices)))
    return [devices[i::jobs] for i in range(jobs)]


def sweep(cases: list[Draw], devices: tuple[str, ...] = DEVICES, jobs: int = 1,
          runner: Sweep | None = None, te_query: str = "graph") -> dict[str, Any]:  # fmt: skip
    """Run the rows (through ``runner``, a new :class:`Sweep` by default, or in ``jobs``
    spawned processes when > 1) and merge their results. The counters of a given ``runner``
    are cumulative."""
    t0 = time.perf_counter()
    shards = _shards(devices, jobs)
    if runner is not None or len(shards) == 1:
        own = runner is None
        runner = runner or Sweep(te_query)
        try:
            parts = [_run_rows(cases, devices, runner)]
        finally:
            if own:
                runner.close()
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(len(shards), mp_context=ctx, initializer=_init,
                                    initargs=(te_query,)) as pool:  # fmt: skip
            parts = list(pool.map(_run_rows, [cases] * len(shards), shards))
    out: dict[str, Any] = dict(configs=len(cases), devices=devices, rows=0, bad=[], builds=0,
                               hits=0, build_s=0.0, undecided=collections.Counter(),
                               selected=collections.Counter(),
                               sources=collections.Counter(),
                               coverage=collections.Counter())  # fmt: skip
    for part in parts:
        for k in ("rows", "builds", "hits", "build_s"):
            out[k] += part[k]
        out["bad"].extend(part["bad"])
        out["undecided"].update(part["undecided"])
        out["selected"].update(part["selected"])
        out["sources"].update(part["sources"])
        out["coverage"].update(part["coverage"])
    out["bad"].sort(key=lambda r: (r["index"], devices.index(r["device"])))
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def format_report(result: dict[str, Any], examples: int = 1) -> str:
    rows, bad = result["rows"], len(result["bad"])
    agree = 100.0 * (rows - bad) / max(rows, 1)
    lines = [f"te_sweep configs={result['configs']} rows={rows} agree={agree:.2f}% "
             f"(elapsed {result['elapsed_s']:.1f} s, {result['builds']} graph builds "
             f"{result['build_s']:.1f} s, {result['hits']} memo hits)"]  # fmt: skip
    picks = collections.defaultdict(collections.Counter)
    for (d, te_pick), n in result["selected"].items():
        picks[d][te_pick] += n
    for d in result["devices"]:
        lines.append(f"TE selected on {d}: " + ", ".join(
            f"{k}={v}" for k, v in sorted(picks[d].items(), key=str)))  # fmt: skip
    lines.append("answered by: " + ", ".join(f"{k}={v}" for k, v in
                                            sorted(result["sources"].items())))
    cov = result["coverage"]
    tags = sorted(t for t in cov if not t.endswith("+fused"))
    lines.append("coverage, rows (TE FusedAttention available): " + ", ".join(
        f"{t}={cov[t]} ({cov[t + '+fused']})" for t in tags))  # fmt: skip
    if result["undecided"]:
        lines.append("TE side: graph queries cuDNN could not answer (support table used): "
                     + ", ".join(f"{k}={v}" for k, v in sorted(result["undecided"].items())))
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in result["bad"]:
        groups[family(row)].append(row)
    lines.append(f"disagreements: {bad} rows in {len(groups)} families")
    for name, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        per = collections.Counter(r["device"] for r in members)
        lines.append(f"- x{len(members)} ({', '.join(f'{d}={n}' for d, n in sorted(per.items()))})"
                     f" {name}")
        for row in members[:examples]:
            lines.append(f"    e.g. {row['device']} {row['name']}")
            lines.append(f"      TE: {row['te_log']}")
            backend = _backend_of(row["diffs"][0], row["diffs"])
            ours = row["our_reasons"].get("error") or row["our_reasons"].get(backend, [])
            lines.append(f"      ours ({backend}): {[x[:400] for x in ours]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=4000, help="number of random configs")
    ap.add_argument("--device", action="append", help="device profile(s) (default: "
                    + " ".join(DEVICES) + ")")  # fmt: skip
    ap.add_argument("--fp8", type=float, default=FP8_SHARE, help="share of FP8 DPA configs")
    ap.add_argument("--te-query", choices=("graph", "table"), default="graph",
                    help="what answers TE's C++ fused query (table: our support table's "
                    "prediction, as te_replay does)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1, help="processes (rows sharded by device)")
    ap.add_argument("--examples", type=int, default=1, help="examples printed per family")
    ap.add_argument("--json", type=Path, help="also write the disagreeing rows here")
    args = ap.parse_args(argv)
    devices = tuple(args.device or DEVICES)
    cases = draws(args.seed, args.n, args.fp8)
    result = sweep(cases, devices, args.jobs, te_query=args.te_query)
    print(format_report(result, args.examples), flush=True)
    if args.json:
        plain = {k: v for k, v in result.items() if k != "selected"}
        args.json.write_text(json.dumps(plain, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
