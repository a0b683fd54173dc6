"""Differential test: our rules against TransformerEngine 2.20.2's real ``get_attention_backend``.

TE runs on CPU (see ``te_cpu.py``) with the device's compute capability, cuDNN version and
flash-attn installs patched in. Its C++ cuDNN query cannot run here: it answers what TE 2.20.2's
C++ refuses before building a graph (``te_cpu.cpp_prechecks``, an oracle written from TE's C++,
independent of our rules) and "supported" otherwise. For a seeded set of configs on catalog
devices we compare TE's ``available_backends`` with our
``RULES_ONLY().decide(config, device, Policy())``:

* ``flash`` / ``flash_variant``: FlashAttention available, and which flavour (FA4 > FA3 > FA2);
* ``unfused``;
* ``fused_python``: FusedAttention against our Python-side rules (PYTHON_RULES + determinism),
  for every config (TE asked again with its C++ query answering "supported", so TE reports
  exactly its Python-side filters);
* ``fused_cpp``: where TE's Python side reached the C++ query, the C++ pre-graph refusal (the
  oracle's first, by its code) against our CPP_RULES;
* ``fused`` / ``fused_sub_backend``: our full FusedAttention verdict, where our prediction of
  cuDNN's verdict (TABLE_RULES) also accepts;
* ``selected``: the backend TE would run vs the one we choose among TE's three candidates.

Every disagreement fails the test unless it is listed in ``EXPECTED_DIFFERENCES`` with a reason.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
import te_cpu

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import DeviceProfile, profile
from te_fl_attention.policy import Policy
from te_fl_attention.probes import default_probes
from te_fl_attention.probes.base import evaluate
from te_fl_attention.probes.flash import fa2 as flash_fa2
from te_fl_attention.probes.flash import probe as flash_probe
from te_fl_attention.probes.fused import cpp as fused_cpp
from te_fl_attention.probes.fused import probe as fused_probe
from te_fl_attention.probes.fused import rules as fused_rules
from te_fl_attention.probes.fused import table as fused_table
from te_fl_attention.selector import Selector


def RULES_ONLY() -> Selector:  # noqa: N802 - reads like a constant at call sites
    """Our rule stage only (no cuDNN graph builds), to compare like for like with TE."""
    return Selector(default_probes(graph=False))

# ------------------------------------------------------------------------------- the devices
#: Catalog GPUs (sm80/89/90/100/120, and sm75) with FA2 2.8.3 and cuDNN 9.28.1 unless overridden;
#: some with FA3/FA4 installed, some with older flash-attn 2 or cuDNN releases that TE's Python
#: rules gate on.
DEVICES = (
    "a100", "a100:fa2=2.3.0,cudnn=9.6.0", "l40s", "rtx4090:fa2=2.4.1",
    "h100", "h100:fa3=3.0.0b1", "h100:fa4=4.0.0b36",
    "h100:fa3=3.0.0b1,fa4=4.0.0b36,cudnn=9.18.0", "h200:fa2=2.5.0,cudnn=9.14.0",
    "b200", "b200:fa4=4.0.0b36", "b200:fa2=2.7.2,cudnn=9.20.0", "b200:cudnn=9.23.1",
    "rtx5090", "rtx5090:fa4=4.0.0b36,cudnn=9.18.0", "t4",
)  # fmt: skip


# ------------------------------------------------------------------------------- the configs
_LAYOUTS = (["bshd_bshd_bshd"] * 4 + ["sbhd_sbhd_sbhd"] * 2 + ["thd_thd_thd"] * 3
            + ["bs3hd", "sbh3d", "t3hd", "th3d", "bshd_bs2hd", "thd_t2hd", "sbhd_bshd_bshd",
               "thd_bshd_bshd", "bshd_sbhd_sbhd", "thd_sbhd_sbhd"])  # fmt: skip
_PAGED = ("paged_kv_bshd_bshd_bshd", "paged_kv_sbhd_sbhd_sbhd", "paged_kv_thd_bshd_bshd",
          "paged_kv_thd_sbhd_sbhd", "paged_kv_bshd_sbhd_sbhd")  # fmt: skip
_MASKS = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
          "padding_causal_bottom_right", "arbitrary")  # fmt: skip
_DIMS = ([(64, 64)] * 4 + [(128, 128)] * 3
         + [(96, 96), (192, 128), (256, 256), (64, 512), (128, 96), (72, 72), (160, 160),
            (512, 512), (48, 48), (256, 128), (128, 64), (200, 200), (264, 264), (40, 40),
            (8, 8)])  # fmt: skip
_SEQS = ([(128, 128)] * 4
         + [(128, 256), (256, 128), (1, 2048), (2048, 2048), (100, 300), (512, 512), (1, 1),
            (4096, 4096)])  # fmt: skip
_HEADS = [(16, 16)] * 4 + [(16, 4), (16, 1), (15, 5), (3, 3), (8, 2), (1, 1)]


def _random_kwargs(rng: random.Random, weight: float) -> dict[str, Any]:
    """One config's fields; ``weight`` scales how often a feature leaves its default."""

    def often(p: float) -> bool:
        return rng.random() < min(0.9, p * weight)

    kw: dict[str, Any] = {"dtype": rng.choice(["bf16"] * 3 + ["fp16"] * 2 + ["fp32"])}
    kw["head_dim_qk"], kw["head_dim_v"] = rng.choice(_DIMS)
    kw["num_heads"], kw["num_gqa_groups"] = rng.choice(_HEADS)
    kw["max_seqlen_q"], kw["max_seqlen_kv"] = rng.choice(_SEQS)
    kw["batch_size"] = rng.choice([1, 2, 4, 8])
    kw["qkv_layout"] = rng.choice(_LAYOUTS)
    kw["attn_mask_type"] = rng.choice(_MASKS)
    if often(0.2):
        kw["window_size"] = rng.choice([(128, 0), (64, 64), (-1, -1), (0, 0), (256, -1), (16, 0)])
    if often(0.3):
        kw["bias_type"] = rng.choice(["post_scale_bias", "pre_scale_bias", "alibi", "alibi"])
        if kw["bias_type"] == "alibi":
            r = rng.random()
            if r < 0.4:
                kw["alibi_slopes_shape"] = (kw["num_heads"],)
            elif r < 0.6:
                kw["alibi_slopes_shape"] = (kw["batch_size"], kw["num_heads"])
        else:
            kw["bias_shape"] = rng.choice(["1hss", "b1ss", "bhss", "11ss", "111s"])
            kw["bias_requires_grad"] = often(0.5)
    if often(0.2):
        kw["dropout"] = 0.1
    if often(0.15):
        kw["softmax_type"] = rng.choice(["off-by-one", "learnable"])
    if often(0.1):
        kw["softcap"] = 30.0
    kw["is_training"] = rng.random() < 0.7
    kw["deterministic"] = often(0.2)
    if often(0.15):
        kw["fp8"] = True
        kw["fp8_recipe"] = rng.choice(["delayed", "delayed", "current", "mxfp8", "block", "nvfp4"])
        kw["fp8_mha"] = often(0.2)
        kw["dtype"] = "fp8_e4m3" if often(0.2) else rng.choice(["bf16", "fp16"])
    if often(0.15):
        kw.update(context_parallel=True, cp_size=rng.choice([2, 4]),
                  cp_comm_type=rng.choice(["p2p", "all_gather", "a2a", "a2a+p2p"]))  # fmt: skip
    if often(0.15):
        kw["kv_cache"] = True
        if rng.random() < 0.6:
            kw["qkv_layout"] = rng.choice(_PAGED)
            kw["page_size"] = rng.choice([256, 64, 16, 512])
        if "padding" not in kw["attn_mask_type"]:
            kw["attn_mask_type"] = rng.choice(["padding", "padding_causal",
                                               "padding_causal_bottom_right"])  # fmt: skip
    if "thd" in kw["qkv_layout"] and often(0.4):
        kw["pad_between_seqs"] = True
    if often(0.1):
        kw["num_splits"] = rng.choice([2, 4])
    for name, p in (("return_max_logit", 0.08), ("has_score_mod", 0.05),
                    ("has_score_mod_bprop", 0.03), ("cuda_graph", 0.05),
                    ("checkpoint_core_attention", 0.05)):  # fmt: skip
        if often(p):
            kw[name] = True
    return kw


def generate(n: int, seed: int, weight: float) -> list[FusedAttnConfig]:
    """``n`` distinct valid configs (combinations FusedAttnConfig refuses are redrawn)."""
    rng = random.Random(seed)
    out: dict[str, FusedAttnConfig] = {}
    while len(out) < n:
        try:
            c = FusedAttnConfig(**_random_kwargs(rng, weight))
        except ValueError:
            continue
        out.setdefault(c.key(), c)
    return list(out.values())


#: Configs behind rule bugs this comparison found (kept so they are always compared).
REGRESSIONS = [
    # MLA with a paged layout: TE's layout-group test does not strip "paged_kv_".
    FusedAttnConfig(head_dim_qk=128, head_dim_v=64, qkv_layout="paged_kv_bshd_bshd_bshd",
                    page_size=256, attn_mask_type="padding", max_seqlen_kv=512),
    # A (1, 1, 1, skv) bias needing dbias: TE reads it as 1hss with one head, b1ss with batch 1.
    *(FusedAttnConfig(bias_type="post_scale_bias", bias_shape="111s", bias_requires_grad=True,
                      batch_size=b, num_heads=h, num_gqa_groups=h, max_seqlen_q=256)
      for b, h in ((4, 1), (1, 16), (4, 16))),
    # thd with padding between sequences: FA4 takes it (seqused_q/k), only FA2 refuses.
    FusedAttnConfig(qkv_layout="thd_thd_thd", attn_mask_type="padding", pad_between_seqs=True),
    # FP8 DPA with bf16 inputs is cuDNN's FP8 sub-backend (determinism needs cuDNN 9.19 there).
    FusedAttnConfig(fp8=True, head_dim_qk=128, deterministic=True),
]  # fmt: skip

#: Configs that reach TE's rarer C++ pre-graph refusals on some of DEVICES (the seeded ones
#: rarely combine FP8 with thd, or CUDA graphs with s_kv % 128 != 0 on cuDNN <= 9.15).
CPP_REACHERS = [
    FusedAttnConfig(max_seqlen_kv=100, cuda_graph=True),  # cuDNN 9.14.0 / 9.6.0 devices
    *(FusedAttnConfig(max_seqlen_q=256, max_seqlen_kv=256, cuda_graph=True, cp_size=2,
                      cp_comm_type=comm, attn_mask_type="causal")  # per-step s_kv of 64
      for comm in ("all_gather", "p2p", "a2a")),
    FusedAttnConfig(fp8=True, head_dim_qk=128, qkv_layout="thd_thd_thd",
                    attn_mask_type="padding", softmax_type="off-by-one"),  # b200:cudnn=9.23.1
    FusedAttnConfig(fp8=True, head_dim_qk=192, head_dim_v=128, qkv_layout="thd_thd_thd",
                    attn_mask_type="padding", is_training=False),
    FusedAttnConfig(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal",
                    softmax_type="learnable"),  # cuDNN < 9.26 on sm90+
]  # fmt: skip

#: Mostly-plain configs, then configs with many features at once.
CONFIGS = (REGRESSIONS + CPP_REACHERS + generate(260, seed=2026, weight=1.0)
           + generate(140, seed=7, weight=1.8))  # fmt: skip


# -------------------------------------------------------------------------------- comparison
@dataclasses.dataclass(frozen=True)
class Mismatch:
    field: str
    spec: str
    config: FusedAttnConfig
    te: Any
    ours: Any
    te_log: tuple[str, ...]
    our_reasons: tuple[str, ...]

    def describe(self) -> str:
        default = FusedAttnConfig().to_dict()
        diff = {k: v for k, v in self.config.to_dict().items() if v != default[k]}
        log = [line[:160] for line in self.te_log if "isabling" in line or "Selected" in line]
        return (f"[{self.field}] on {self.spec}: TE={self.te!r} ours={self.ours!r}\n"
                f"    config: {diff}\n    TE log: {log}\n    our reasons: {self.our_reasons}")


@dataclasses.dataclass(frozen=True)
class Expected:
    """A deliberate difference: which mismatches it covers, and why."""

    name: str
    matches: Callable[[Mismatch, Any], bool]
    why: str


def _only_fa3_softcap(m: Mismatch, decision: Any) -> bool:
    fa3 = decision.result("fa3")
    codes = [r.code for r in fa3.reasons]
    return (m.field in ("flash", "flash_variant", "selected") and m.config.softcap != 0.0
            and codes == ["fa3.softcap"])  # fmt: skip


EXPECTED_DIFFERENCES = (
    # TE 2.20.2 keeps FA3 for softcap when the installed FA3 build's signature takes `softcap`
    # (backends.py inspects flash_attn_interface). Package metadata cannot show that, so our
    # fa3.softcap rule refuses softcap on FA3; the driver emulates a softcap-capable FA3 build.
    Expected("fa3_softcap", _only_fa3_softcap,
             "TE probes FA3's signature for softcap; our rules see only package metadata"),
)  # fmt: skip

NO_TRITON = Policy(triton=False)


def compare(te: te_cpu.TE, selector: Selector, c: FusedAttnConfig, spec: str, d: DeviceProfile
            ) -> tuple[list[Mismatch], dict[str, int], te_cpu.TEAnswer, Any]:  # fmt: skip
    """Mismatches for one (config, device), and how many fields were compared."""
    a = te.decide(c, d)
    dec = selector.decide(c, d, Policy())
    te_only = selector.decide(c, d, NO_TRITON)
    fl, fu, un = dec.result("flash"), dec.result("fused"), dec.result("unfused")
    python_side = evaluate((*fused_rules.PYTHON_RULES, fused_rules.determinism), c, d)
    table_ok = not evaluate(fused_table.TABLE_RULES, c, d)
    checks: list[tuple[str, Any, Any, Any]] = [
        ("flash", a.flash, fl.supported, fl),
        ("unfused", a.unfused, un.supported, un),
        ("fused_python", a.fused_python, not python_side, python_side),
    ]
    if a.cpp_queries:
        cpp = evaluate(fused_cpp.CPP_RULES, c, d)
        theirs = cpp_code(a.cpp_refusal)
        codes = [r.code for r in cpp]
        checks.append(("fused_cpp", theirs, theirs if theirs in codes else
                       (codes[0] if codes else None), cpp))  # fmt: skip
    if a.flash and fl.supported:
        checks.append(("flash_variant", a.flash_flavour, fl.detail.get("variant"), fl))
    if table_ok:
        checks.append(("fused", a.fused, fu.supported, fu))
        if a.fused and fu.supported:
            checks.append(("fused_sub_backend", a.fused_sub_backend, fu.detail["sub_backend"], fu))
    if table_ok or not a.fused:
        checks.append(("selected", a.selected, te_only.chosen, te_only))
    out = [Mismatch(field, spec, c, theirs, ours, a.log, _codes(where))
           for field, theirs, ours, where in checks if theirs != ours]  # fmt: skip
    return out, collections.Counter(f for f, *_ in checks), a, dec


#: The oracle's keys whose refusal our CPP_RULES state under another code; keys of refusals that
#: cannot happen after TE's Python filters (fp8_recipe, mxfp8_cudnn, dtype) map to nothing ours.
_CPP_CODES = {"fp8_alibi": "fused_cpp.fp8_bias"}


def cpp_code(key: str | None) -> str | None:
    """Our code for a ``te_cpu.cpp_prechecks`` key."""
    return None if key is None else _CPP_CODES.get(key, f"fused_cpp.{key}")


def _codes(where: Any) -> tuple[str, ...]:
    """Reason codes of a reason list, a probe result (variants included) or a decision."""
    if isinstance(where, (list, tuple)):
        return tuple(r.code for r in where)
    if hasattr(where, "results"):
        return tuple(f"{r.backend}:{code}" for r in where.results for code in _codes(r))
    own = tuple(r.code for r in where.reasons)
    return own + tuple(f"{v.backend}:{r.code}" for v in where.variants for r in v.reasons)


@dataclasses.dataclass
class Summary:
    compared: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    disagreed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    expected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unexpected: dict[str, list[Mismatch]] = dataclasses.field(default_factory=dict)
    te_filters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cpp_refusals: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    pairs: int = 0

    def report(self) -> str:
        lines = [f"{len(CONFIGS)} configs x {len(DEVICES)} devices = {self.pairs} pairs"]
        for field, n in sorted(self.compared.items()):
            bad = self.disagreed[field]
            lines.append(f"  {field:18s} compared {n:5d}  agree {n - bad:5d}  "
                         f"({100 * (n - bad) / n:.2f}%)  expected diffs {self.expected[field]}")
        lines.append(f"  distinct TE filters exercised: {len(self.te_filters)}")
        lines.append("  TE C++ pre-graph refusals: " + ", ".join(
            f"{k}={v}" for k, v in sorted(self.cpp_refusals.items())))  # fmt: skip
        return "\n".join(lines)


def _filter_name(line: str) -> str:
    """A TE log line without its values: "Disabling FlashAttention 2 for num_splits"."""
    return re.split(r"[=:%(]|\bFound\b", line)[0].strip()


@pytest.fixture(scope="module")
def parity(te_selector: te_cpu.TE) -> Summary:
    s = Summary()
    for spec in DEVICES:
        d = profile(spec)
        selector = RULES_ONLY()
        s.unexpected[spec] = []
        for c in CONFIGS:
            mismatches, counts, answer, decision = compare(te_selector, selector, c, spec, d)
            s.pairs += 1
            s.compared.update(counts)
            s.te_filters.update(_filter_name(x) for x in answer.log if "isabling" in x)
            if answer.cpp_refusal is not None:
                s.cpp_refusals[answer.cpp_refusal] += 1
            for m in mismatches:
                s.disagreed[m.field] += 1
                if any(e.matches(m, decision) for e in EXPECTED_DIFFERENCES):
                    s.expected[m.field] += 1
                else:
                    s.unexpected[spec].append(m)
    return s


@pytest.mark.parametrize("spec", DEVICES)
def test_rules_agree_with_te(parity: Summary, spec: str) -> None:
    bad = parity.unexpected[spec]
    shown = "\n".join(m.describe() for m in bad[:8])
    assert not bad, f"{len(bad)} disagreement(s) with TE 2.20.2 on {spec}:\n{shown}"


def test_parity_covers_enough(parity: Summary) -> None:
    print("\n" + parity.report())
    assert len(CONFIGS) >= 300 and parity.pairs == len(CONFIGS) * len(DEVICES)
    assert parity.compared["fused"] >= 1500, parity.report()
    assert parity.compared["flash_variant"] >= 500, parity.report()
    assert parity.compared["selected"] >= 3000, parity.report()
    # The configs reach most of get_attention_backend's filters (about 90 distinct ones).
    assert len(parity.te_filters) >= 60, sorted(parity.te_filters)
    # TE's verdicts are not one-sided: every backend is both accepted and refused somewhere.
    assert parity.compared["flash"] > parity.compared["flash_variant"] > 0
    # Every C++ pre-graph refusal a config can reach after TE's Python filters is exercised (a
    # validated config holds no zero token count or page dimension, nor paged KV without a
    # padding mask; FP8 max_logit, MXFP8 below cuDNN 9.21 and fp32 are TE Python filters).
    reachable = {"thd_mask", "pre_scale_bias", "thd_sm90", "cuda_graph_cudnn",
                 "thd_learnable_bwd", "fp8_format", "fp8_thd_cudnn", "fp8_thd_bwd_sm",
                 "fp8_thd_softmax", "fp8_thd_head_dim", "fp8_bias", "fp8_alibi"}
    assert reachable <= set(parity.cpp_refusals), sorted(reachable - set(parity.cpp_refusals))
    assert parity.compared["fused_cpp"] >= 1500, parity.report()


def test_comparison_catches_a_wrong_rule(te_selector: te_cpu.TE, monkeypatch) -> None:
    """Drop FA2's head-dim rule: the comparison must flag TE's refusal of head_dim 264."""
    c, spec = FusedAttnConfig(head_dim_qk=264, is_training=False), "a100"
    assert compare(te_selector, RULES_ONLY(), c, spec, profile(spec))[0] == []
    fa2 = tuple(r for r in flash_fa2.FA2 if r is not flash_fa2.fa2_head_dim)
    monkeypatch.setitem(flash_probe.FLAVOUR_RULES, "fa2", fa2)
    fields = {m.field for m in compare(te_selector, RULES_ONLY(), c, spec, profile(spec))[0]}
    assert {"flash", "selected"} <= fields


def test_comparison_catches_a_missing_cpp_rule(te_selector: te_cpu.TE, monkeypatch) -> None:
    """Drop our C++ F16 rule: TE's C++ refuses thd q and k/v on sm80 (before cuDNN), we would
    not; the comparison must flag it in ``fused_cpp`` and ``fused``."""
    c, spec = FusedAttnConfig(qkv_layout="thd_thd_thd", attn_mask_type="padding"), "a100"
    mismatches, _, answer, _ = compare(te_selector, RULES_ONLY(), c, spec, profile(spec))
    assert mismatches == [] and answer.cpp_refusal == "thd_sm90" and not answer.fused
    assert answer.fused_python  # TE's Python side alone accepts it
    cpp = tuple(r for r in fused_cpp.CPP_RULES if r.__name__ != "cpp_f16")
    monkeypatch.setattr(fused_cpp, "CPP_RULES", cpp)
    monkeypatch.setattr(fused_probe, "BINDING_RULES",
                        (*fused_rules.PYTHON_RULES, *cpp, fused_rules.determinism))
    fields = {m.field for m in compare(te_selector, RULES_ONLY(), c, spec, profile(spec))[0]}
    assert {"fused_cpp", "fused"} <= fields


def test_cpp_oracle_reads_what_te_hands_the_cpp(te_selector: te_cpu.TE) -> None:
    """The oracle sees TE's FusedAttentionParams: MXFP8 hands cuDNN a bhsd layout for a mixed
    one (only the gradient layout stays mixed), ALiBi with slopes arrives as a post_scale_bias,
    and the CUDA-graph bug check reads C++'s qkv_format (sbhd_2bshd is not sbhd)."""
    cases = [
        (FusedAttnConfig(fp8=True, fp8_recipe="mxfp8", head_dim_qk=128,
                         qkv_layout="sbhd_bshd_bshd"), "b200", "fp8_format"),
        (FusedAttnConfig(fp8=True, fp8_recipe="mxfp8", head_dim_qk=128, is_training=False,
                         qkv_layout="sbhd_bshd_bshd"), "b200", None),
        (FusedAttnConfig(fp8=True, head_dim_qk=128, bias_type="alibi", attn_mask_type="causal",
                         alibi_slopes_shape=(16,)), "b200", "fp8_bias"),
        (FusedAttnConfig(fp8=True, head_dim_qk=128, bias_type="alibi", attn_mask_type="causal"),
         "b200", "fp8_alibi"),
        (FusedAttnConfig(max_seqlen_kv=100, cuda_graph=True), "h100:cudnn=9.15.0",
         "cuda_graph_cudnn"),
        (FusedAttnConfig(max_seqlen_kv=100, cuda_graph=True, qkv_layout="sbhd_bshd_bshd"),
         "h100:cudnn=9.15.0", None),
    ]  # fmt: skip
    for c, spec, key in cases:
        answer = te_selector.decide(c, profile(spec), log=False)
        assert answer.cpp_queries and answer.cpp_refusal == key, (c, spec, answer)
        ours = {r.code for r in evaluate(fused_cpp.CPP_RULES, c, profile(spec))}
        assert ours == ({cpp_code(key)} if key else set()), (c, spec, ours)


def test_fa3_softcap_difference_is_the_documented_one(te_selector: te_cpu.TE) -> None:
    c, spec = FusedAttnConfig(softcap=30.0), "h100:fa3=3.0.0b1"
    mismatches, _, answer, decision = compare(te_selector, RULES_ONLY(), c, spec, profile(spec))
    assert answer.flash_flavour == "fa3"  # TE: a softcap-capable FA3 build runs it
    assert decision.result("flash").detail["variant"] == "fa2"  # ours: FA3 refused
    assert mismatches and all(EXPECTED_DIFFERENCES[0].matches(m, decision) for m in mismatches)
    strict = te_cpu.TE(fa3_supports_softcap=False)  # an FA3 build without softcap: agreement
    assert compare(strict, RULES_ONLY(), c, spec, profile(spec))[0] == []


def test_attention_params_round_trip(te_selector: te_cpu.TE) -> None:
    """Our converter builds AttentionParams that FusedAttnConfig.from_attention_params reads
    back as the same config (TE passes the actual softmax scale; a (1, 1, 1, skv) bias with one
    head or a batch of one is not TE's 111s but its 1hss/b1ss, which our config reads as 11ss)."""
    bias_111s = [FusedAttnConfig(bias_type="post_scale_bias", bias_shape="111s", batch_size=b,
                                 num_heads=h, num_gqa_groups=h)
                 for b in (1, 2) for h in (1, 4)]  # fmt: skip
    for c in [*CONFIGS, *bias_111s]:
        params = te_cpu.attention_params(te_selector.te, c)
        back = FusedAttnConfig.from_attention_params(params)
        assert back.softmax_scale == pytest.approx(c.scale)
        want = c.replace(softmax_scale=back.softmax_scale)
        if c.bias_shape == "111s" and 1 in (c.num_heads, c.batch_size):
            want = want.replace(bias_shape="11ss")
        assert back == want, (c.to_dict(), back.to_dict())


def test_te_is_the_real_one(te_selector: te_cpu.TE) -> None:
    """The selector under test is TE's own code from the installed 2.20.2 wheel."""
    utils = te_selector.te.utils
    assert utils.get_attention_backend.__module__ == (
        "transformer_engine.pytorch.attention.dot_product_attention.utils"
    )
    assert "site-packages" in utils.__file__ or "dist-packages" in utils.__file__
    assert isinstance(te_selector.te.tex, te_cpu.StubExtension)
    assert {m.name for m in te_selector.te.tex.DType} == set(te_cpu.DTYPE_MEMBERS)
    assert te_selector.validator_source in ("imported", "source", "stand-in")
