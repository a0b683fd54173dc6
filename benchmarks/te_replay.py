"""Replay TransformerEngine's attention test configurations through TE's selector and ours.

For every ``ModelConfig`` in TE's ``tests/pytorch/attention/`` (``te_model_configs.json``,
generated from research/te-selection.md Appendix A) x dtype (fp16, bf16) x device profile
(a100, h100, b200) x the layouts / variants TE's test for that config uses, one
``AttentionParams`` is built the way TE's test helper ``get_available_attention_backends`` builds
it, and handed to

* TE 2.20.2's own ``get_attention_backend``, run on CPU (``tests/probes/te_cpu.py``: compute
  capability, cuDNN version and flash-attn installs patched to the profile); its C++ cuDNN query
  ``tex.get_fused_attn_backend``, which cannot run here, refuses what TE's C++ refuses before
  building a graph (``te_cpu.cpp_prechecks``, an oracle written from TE's C++) and otherwise
  answers with our prediction of cuDNN's verdict (``probes.fused.table.TABLE_RULES``, via
  ``tests/te/stub_tex.table_fused_backend``), and
* our plugin's ``get_attention_backend`` (rule stage: ``Selector(default_probes(graph=False))``)
  with the same policy (TE's defaults; our Triton candidate off, ``TE_FL_ATTN_TRITON=0``, since
  TE has none).

Both 6-tuples are compared field by field (flash / fused / unfused availability, the flash-attn
version, the fused sub-backend, the selected backend); every disagreement is printed with both
sides' reasons. Disagreements that are understood are listed in :data:`EXPLAINED` (each with the
README sentence that explains it); anything else is a bug.

    python benchmarks/te_replay.py [--sample N] [--device a100 ...] [--verbose]
    python benchmarks/te_replay.py --from-appendix PATH/te-selection.md   # regenerate the JSON
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import dataclasses
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests" / "probes", ROOT / "tests" / "te"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CONFIGS = Path(__file__).resolve().with_name("te_model_configs.json")
DEVICES = ("a100", "h100", "b200")
DTYPES = ("fp16", "bf16")
FIELDS = ("flash", "fused", "unfused", "flash_version", "fused_sub_backend", "selected")
DENSE_LAYOUTS = ("sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd", "bs3hd",
                 "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd")  # fmt: skip
THD_LAYOUTS = ("t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd")


# ---------------------------------------------------------------------------- the configs
def parse_appendix(path: Path) -> list[dict[str, Any]]:
    """Appendix A's tables as records: file, dict, key, b, sq, skv, h, hg, dqk, dv, kwargs."""
    text = path.read_text(encoding="utf-8")
    text = text[text.index("## Appendix A"):]
    text = text[:text.index("\n## ", 5)] if "\n## " in text[5:] else text
    out, source = [], None
    for line in text.splitlines():
        m = re.match(r"### A\.\d `([^`]+)`", line)
        if m:
            source = m.group(1).rsplit("/", 1)[-1]
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[2].isdigit():
            continue
        kwargs = {}
        if cells[9]:
            call = ast.parse(f"f({cells[9]})", mode="eval").body
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}  # type: ignore
        b, sq, skv, h, hg, dqk, dv = (int(c) for c in cells[2:9])
        out.append(dict(file=source, dict=cells[0], key=cells[1], b=b, sq=sq, skv=skv, h=h, hg=hg,
                        dqk=dqk, dv=dv, kwargs=kwargs))  # fmt: skip
    return out


def load_configs(path: Path = CONFIGS) -> list[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8"))["configs"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One query: a ModelConfig, a dtype, a device profile, a layout and the test's variant."""

    entry: tuple  # (file, dict, key)
    cfg: dict
    dtype: str
    device: str
    layout: str
    pad_between_seqs: bool = False
    swa: bool = False
    cp_comm_type: str | None = None
    kv_cache: str | None = None  # None, "paged", "non-paged"
    is_training: bool = True

    @property
    def name(self) -> str:
        extra = [x for x in (self.cp_comm_type and f"cp={self.cp_comm_type}",
                             self.kv_cache, "swa" if self.swa else None,
                             "pad_between_seqs" if self.pad_between_seqs else None,
                             None if self.is_training else "inference") if x]  # fmt: skip
        return f"{self.entry[1]}/{self.entry[2]} {self.dtype} {self.device} {self.layout}" + \
            (f" [{', '.join(extra)}]" if extra else "")  # fmt: skip


def _default_layout(c: dict) -> str:
    """TE's test_dot_product_attention default layout for a config."""
    mla, gqa = c["dqk"] != c["dv"], c["h"] != c["hg"]
    if c["sq"] == c["skv"]:
        return "sbhd_sbhd_sbhd" if mla or gqa else "sb3hd"
    return "bshd_bshd_bshd" if mla else "bshd_bs2hd"


def _layouts(c: dict) -> list[tuple[str, dict[str, Any]]]:
    """(layout, variant) pairs TE's test for this config's dict queries (research 9.2)."""
    d, kw = c["dict"], c["kwargs"]
    fa4_or_other = {
        "max_logit": ["sbhd_sbhd_sbhd", "thd_thd_thd"],
        "softmax": ["bshd_bshd_bshd", "thd_thd_thd"],
        "fa4_mla": ["bshd_bshd_bshd"],
        "fa4_swa": ["sbhd_sbhd_sbhd", "bshd_bshd_bshd"],
        "fa4_varlen": ["thd_thd_thd", "bshd_bshd_bshd"],
        "d256": ["bshd_bs2hd", "thd_t2hd"],
        "swa": ["thd_thd_thd", "sbhd_sbhd_sbhd"],
        "te_layer": ["sbhd_sbhd_sbhd", "bshd_bshd_bshd", "thd_thd_thd"],
        "layout": list(DENSE_LAYOUTS),
        "layout_thd": list(THD_LAYOUTS),
    }
    if c["file"] == "test_attention_with_cp.py":
        out = []
        for fmt in ("bshd", "sbhd", "thd"):
            for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
                out.append(("_".join([fmt] * 3), {"cp_comm_type": comm}))
        return out
    if c["file"] == "test_kv_cache.py":
        return [(f"{pre}{fmt}_{fmt}_{fmt}", {"kv_cache": kind}) for fmt in ("bshd", "sbhd")
                for pre, kind in (("", "non-paged"), ("paged_kv_", "paged"))]  # fmt: skip
    layouts = fa4_or_other.get(d, [_default_layout(c)])
    variants: dict[str, Any] = {}
    if d in ("swa", "fa4_swa"):
        variants["swa"] = True
    if d == "fa4_hdim256" or kw.get("bias_shape") == "111s":
        variants["is_training"] = False
    out = []
    for layout in layouts:
        pads = (True, False) if d == "layout_thd" else (False,)
        out.extend((layout, {**variants, "pad_between_seqs": p}) for p in pads)
    return out


def _skip(c: dict, layout: str, v: dict[str, Any]) -> bool:
    """Combinations TE's tests skip (or that cannot be expressed)."""
    kw = c["kwargs"]
    packed3 = "3" in layout
    packed2 = "2" in layout
    if packed3 and (c["sq"] != c["skv"] or c["h"] != c["hg"] or c["dqk"] != c["dv"]):
        return True
    if packed2 and c["dqk"] != c["dv"]:
        return True
    comm = v.get("cp_comm_type")
    if comm is not None:
        bias = kw.get("attn_bias_type", "no_bias") != "no_bias"
        swa = kw.get("window_size", (-1, -1)) != (-1, -1) and \
            tuple(kw.get("window_size", (-1, -1))) not in ((-1, 0),)  # fmt: skip
        if (bias and comm != "p2p") or (swa and comm in ("p2p", "a2a+p2p")):
            return True
        if comm == "a2a" and (c["h"] % 2 or c["hg"] % 2):
            return True
        if c["dict"] == "flash_attn" and c["dqk"] != c["dv"] and comm != "p2p":
            return True
    return False


def cases(entries: list[dict[str, Any]], devices: tuple[str, ...] = DEVICES,
          dtypes: tuple[str, ...] = DTYPES) -> Iterator[Case]:  # fmt: skip
    """Every query of the replay, in a stable order."""
    for c in entries:
        for layout, v in _layouts(c):
            if _skip(c, layout, v):
                continue
            for dtype in dtypes:
                for device in devices:
                    yield Case((c["file"], c["dict"], c["key"]), c, dtype, device, layout, **v)


# ---------------------------------------------------------------------------- AttentionParams
@dataclasses.dataclass
class _CacheManager:
    max_pages_per_seq: int


@dataclasses.dataclass
class _InferenceParams:
    is_paged: bool
    page_size: int | None
    total_num_pages: int | None
    cache_manager: _CacheManager | None


def attention_params(te: Any, case: Case) -> Any:
    """The AttentionParams TE's test helper builds for ``case`` (tests/pytorch/utils.py)."""
    import torch

    c, kw = case.cfg, case.cfg["kwargs"]
    utils = te.utils
    b, sq, skv, h, hg, dqk, dv = (c[k] for k in ("b", "sq", "skv", "h", "hg", "dqk", "dv"))
    mask = kw.get("attn_mask_type", "no_mask")
    # DotProductAttention passes q.shape[0] / k.shape[0] as num_tokens_q/kv for a thd q (kv)
    # format, t3hd and th3d included (TE's C++ refuses a ragged tensor without them).
    thd = utils.get_qkv_format(case.layout)[1] == "thd"
    if (thd or case.kv_cache) and "padding" not in mask:
        mask = "padding" if mask == "no_mask" else f"padding_{mask}"
    window = kw.get("window_size", (-1, -1))
    if case.swa and tuple(window) == (-1, -1):
        window = [2, 2]
    window = utils.check_set_window_size(mask, window)
    bias_type = kw.get("attn_bias_type", "no_bias")
    bias_code = kw.get("bias_shape", "1hss")
    alibi = None
    if bias_type == "alibi" and kw.get("alibi_type") == "custom":
        alibi = [h] if bias_code == "1hss" else [b, h]
    shape = None
    if bias_type == "post_scale_bias":
        shape = {"bhss": (b, h, sq, skv), "1hss": (1, h, sq, skv), "b1ss": (b, 1, sq, skv),
                 "11ss": (1, 1, sq, skv), "111s": (1, 1, 1, skv)}[bias_code]  # fmt: skip
    grad = bias_type == "post_scale_bias" and dqk <= 128 and dv <= 128 and bias_code != "111s"
    inference = None
    if case.kv_cache == "paged":
        pages = -(-skv // 16)
        inference = _InferenceParams(True, 16, pages * b, _CacheManager(pages))
    elif case.kv_cache:
        inference = _InferenceParams(False, None, None, None)
    comm = case.cp_comm_type
    cp_size = 1 if comm is None else (4 if comm == "a2a+p2p" else 2)
    return utils.AttentionParams(
        qkv_type=torch.Tensor, qkv_dtype=getattr(torch, {"fp16": "float16",
                                                          "bf16": "bfloat16"}[case.dtype]),
        qkv_layout=case.layout, batch_size=b, num_heads=h, num_gqa_groups=hg,
        max_seqlen_q=sq, max_seqlen_kv=skv, num_tokens_q=b * sq if thd else 0,
        num_tokens_kv=b * skv if thd else 0, head_dim_qk=dqk, head_dim_v=dv,
        attn_mask_type=mask, window_size=window, alibi_slopes_shape=alibi,
        core_attention_bias_type=bias_type, core_attention_bias_shape=shape,
        core_attention_bias_requires_grad=grad, pad_between_seqs=case.pad_between_seqs,
        attention_dropout=float(kw.get("dropout_p", 0.0)), context_parallel=comm is not None,
        cp_comm_type=comm or "p2p", cp_size=cp_size, cp_size_a2a=2 if comm == "a2a+p2p" else 1,
        deterministic=False, is_training=case.is_training, fp8=False, fp8_meta=None,
        inference_params=inference, softmax_type=kw.get("softmax_type", "vanilla"),
        return_max_logit=bool(kw.get("return_max_logit", False)) or c["dict"] == "max_logit",
        num_splits=int(kw.get("num_splits", 1)), softmax_scale=dqk ** -0.5,
    )  # fmt: skip


# ---------------------------------------------------------------------------- the two sides
@dataclasses.dataclass
class Outcome:
    case: Case
    te: dict[str, Any]
    ours: dict[str, Any]
    te_log: tuple[str, ...]
    our_reasons: dict[str, tuple[str, ...]]

    def diffs(self) -> list[str]:
        return [f for f in FIELDS if self.te[f] != self.ours[f]]


def _as_fields(t: tuple) -> dict[str, Any]:
    flash, version, fused, sub, unfused, avail = t
    return dict(flash=bool(avail[0]), fused=bool(avail[1]), unfused=bool(avail[2]),
                flash_version=str(version) if avail[0] and version is not None else None,
                fused_sub_backend=int(sub) if avail[1] and sub is not None else None,
                selected="flash" if flash else "fused" if fused else
                "unfused" if unfused else None)  # fmt: skip


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Replay:
    """TE's selector (te_cpu) and ours (the plugin's backend, rule stage) side by side."""

    def __init__(self) -> None:
        import logging

        # our "no backend" warnings repeat TE's verdicts here: keep them out of the report
        logging.getLogger("te_fl_attention.plugin").setLevel(logging.ERROR)

        import stub_tex
        import te_cpu

        from te_fl_attention.plugin.te_backend import TEBackend
        from te_fl_attention.policy import ENV_VARS
        from te_fl_attention.probes import default_probes
        from te_fl_attention.selector import Selector

        self.te = te_cpu.TE()
        self.prechecks = te_cpu.cpp_prechecks
        self.table = stub_tex.table_fused_backend
        self.env_vars = ENV_VARS
        self.selector = Selector(default_probes(graph=False))
        self.backends: dict[str, Any] = {}
        self._make = lambda spec: TEBackend(self.selector, spec)
        self.debug = logging.DEBUG

    def run(self, case: Case) -> Outcome:
        from te_fl_attention.device import profile

        device = profile(case.device)
        backend = self.backends.get(case.device) or self.backends.setdefault(
            case.device, self._make(device))
        tex = self.te.te.tex
        saved = tex.get_fused_attn_backend
        tex.get_fused_attn_backend = lambda params: self.cpp_query(params, device)
        ours_env = {k: None for k in self.env_vars} | {"TE_FL_ATTN_TRITON": "0"}
        try:
            with self.te.device(device), self.te._captured_log(self.debug) as lines, \
                    warnings.catch_warnings(), _env(**ours_env):  # fmt: skip
                warnings.simplefilter("ignore")
                params = attention_params(self.te.te, case)
                te_answer = self.te.te.utils.get_attention_backend(params)
                ours = backend(params)
                decision = backend.decide(params)
        finally:
            tex.get_fused_attn_backend = saved
        reasons = {}
        for r in decision.results:
            codes = [f"{x.code}: {x.message}" for x in r.reasons]
            codes += [f"{v.backend} {x.code}: {x.message}" for v in r.variants for x in v.reasons]
            reasons[r.backend] = tuple(codes)
        log = tuple(x for x in lines if "isabling" in x or "Selected" in x)
        return Outcome(case, _as_fields(te_answer), _as_fields(ours), log, reasons)

    def cpp_query(self, params: Any, device: Any) -> tuple[int, str]:
        """TE's C++ query: its own pre-graph refusals, then the predicted cuDNN verdict."""
        from te_fl_attention.probes.base import cudnn_version

        refused = self.prechecks(params, device.sm, cudnn_version(device) or (0, 0, 0))
        if refused is not None:
            return -1, refused[1]
        return self.table(params, device)


# ---------------------------------------------------------------------------- explanations
@dataclasses.dataclass(frozen=True)
class Explanation:
    name: str
    matches: Callable[[Outcome, str], bool]
    readme: str


#: Understood disagreements (each a README sentence). Empty: every field agreed on every case of
#: the last full replay; a new disagreement is either a rule bug or gets an entry here.
EXPLAINED: tuple[Explanation, ...] = ()


def explained(outcome: Outcome, field: str) -> Explanation | None:
    return next((e for e in EXPLAINED if e.matches(outcome, field)), None)


# ---------------------------------------------------------------------------- report
def replay(selected: list[Case], verbose: bool = False) -> dict[str, Any]:
    rep = Replay()
    selected_by: collections.Counter = collections.Counter()
    agree: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    unexplained: list[tuple[Outcome, str]] = []
    explained_count: collections.Counter = collections.Counter()
    for case in selected:
        outcome = rep.run(case)
        selected_by[(case.device, outcome.te["selected"], outcome.ours["selected"])] += 1
        bad = set(outcome.diffs())
        for f in FIELDS:
            key = (f, case.device)
            total[key] += 1
            if f not in bad:
                agree[key] += 1
            elif explained(outcome, f):
                explained_count[(f, explained(outcome, f).name)] += 1  # type: ignore[union-attr]
            else:
                unexplained.append((outcome, f))
    return dict(agree=agree, total=total, unexplained=unexplained, explained=explained_count,
                cases=len(selected), selected=selected_by)  # fmt: skip


def format_report(result: dict[str, Any], devices: tuple[str, ...]) -> str:
    lines = [f"TE 2.20.2 vs te-fl-attention (rule stage): {result['cases']} queries, "
             "agreeing / compared",
             f"{'field':<18}" + "".join(f"{d:>16}" for d in devices) + f"{'all':>16}"]
    for f in FIELDS:
        row, a_all, t_all = f"{f:<18}", 0, 0
        for d in devices:
            a, t = result["agree"][(f, d)], result["total"][(f, d)]
            a_all, t_all = a_all + a, t_all + t
            row += f"{a:>9}/{t:<6}"
        lines.append(row + f"{a_all:>9}/{t_all:<6}({100 * a_all / max(t_all, 1):.2f}%)")
    picks = collections.defaultdict(collections.Counter)
    for (d, te_pick, _), n in result["selected"].items():
        picks[d][te_pick] += n
    for d in devices:
        lines.append(f"TE selected on {d}: " + ", ".join(f"{k}={v}" for k, v in
                                                     sorted(picks[d].items(), key=str)))
    for (f, name), n in sorted(result["explained"].items()):
        lines.append(f"explained: {f} x{n} ({name})")
    lines.append(f"unexplained disagreements: {len(result['unexplained'])}")
    for outcome, f in result["unexplained"]:
        lines.append(f"- [{f}] {outcome.case.name}: TE={outcome.te[f]!r} ours={outcome.ours[f]!r}")
        lines.append(f"    TE: {list(outcome.te_log)}")
        key = {"flash_version": "flash", "fused_sub_backend": "fused"}.get(f, f)
        ours = outcome.our_reasons.get(key, ()) if key != "selected" else \
            tuple(x for v in outcome.our_reasons.values() for x in v)  # fmt: skip
        lines.append(f"    ours: {list(ours)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=1, help="replay every N-th query")
    ap.add_argument("--device", action="append", choices=DEVICES, help="device profile(s)")
    ap.add_argument("--from-appendix", type=Path, help="regenerate te_model_configs.json")
    args = ap.parse_args(argv)
    if args.from_appendix:
        entries = parse_appendix(args.from_appendix)
        CONFIGS.write_text(json.dumps({"source": "research/te-selection.md Appendix A (TE main "
                                       "@ d0067d0, tests/pytorch/attention/)",
                                       "configs": entries}, indent=1) + "\n")  # fmt: skip
        print(f"wrote {len(entries)} configs to {CONFIGS}")
        return 0
    devices = tuple(args.device or DEVICES)
    selected = list(cases(load_configs(), devices))[:: max(args.sample, 1)]
    result = replay(selected)
    print(format_report(result, devices))
    return 1 if result["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
