"""TE's 6-tuple from our Selector (``plugin.te_backend``): memo, translation, shape predicates.

In-process, without TE: params are duck-typed dataclasses like TE's ``AttentionParams``.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import sys
import types
from typing import Any

import pytest
import torch
from packaging.version import Version

from te_fl_attention.config import FusedAttnConfig, te_max_tokens
from te_fl_attention.device import profile
from te_fl_attention.plugin import te_backend
from te_fl_attention.plugin.te_backend import (
    TRITON_VERSION,
    BackendVersion,
    TEBackend,
    env_defaults,
    representative,
    shape_predicates,
)
from te_fl_attention.policy import ENV_VARS, Policy, prefer
from te_fl_attention.probes import default_probes
from te_fl_attention.selector import Selector


@dataclasses.dataclass
class Params:
    qkv_type: type = torch.Tensor
    qkv_dtype: torch.dtype = torch.bfloat16
    qkv_layout: str = "bshd_bshd_bshd"
    batch_size: int = 2
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    num_tokens_q: int = 0
    num_tokens_kv: int = 0
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: str = "causal"
    window_size: Any = (-1, 0)
    core_attention_bias_type: str = "no_bias"
    core_attention_bias_shape: Any = None
    alibi_slopes_shape: Any = None
    attention_dropout: float = 0.0
    deterministic: bool = False
    is_training: bool = True
    fp8: bool = False
    fp8_meta: Any = None
    inference_params: Any = None


def rules_backend(device: str = "h100") -> TEBackend:
    return TEBackend(Selector(default_probes(graph=False)), device)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_h100_and_a100_answers() -> None:
    h100 = rules_backend("h100")(Params())
    assert h100[:5] == (False, Version("2.8.3"), True, 1, False) and h100[5] == [True] * 3
    assert isinstance(h100[1], BackendVersion) and h100[1].backend == "fa2"
    assert h100[1].allowed == ("fa2", "triton") and h100[1].heads == (16, 16)
    a100 = rules_backend("a100")(Params(qkv_dtype=torch.float16))
    assert a100[:5] == (True, Version("2.8.3"), False, 1, False)
    fp32 = rules_backend("h100")(Params(qkv_dtype=torch.float32))
    # fp32: flash-attn and cuDNN refuse, our Triton kernel takes fp32 (the flash tier)
    assert fp32[0] and str(fp32[1]) == TRITON_VERSION and fp32[1].allowed == ("triton",)
    assert fp32[2:5] == (False, None, False) and fp32[5] == [True, False, True]


def test_triton_version_is_distinct_and_compares_as_a_version() -> None:
    v = Version(TRITON_VERSION)
    assert v.local == "tefl.triton" and v.major == 0
    assert v != Version("2.8.3") and v.major not in (3, 4)  # TE's FA3/FA4 dispatch stays off
    d = rules_backend()
    fab = d(Params(qkv_dtype=torch.float32))[1]
    assert fab == v and hash(fab) == hash(v) and str(fab) == TRITON_VERSION


def test_memo_hits_and_env_and_prefer(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = rules_backend()
    p = Params()
    first = backend(p)
    assert backend(Params()) == first and backend.stats["misses"] == 1
    assert backend(p)[5] is not first[5]  # a fresh available_backends list each call
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    assert backend(p)[:3] == (True, first[1], False)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    assert backend(p)[2] is True  # the seeded value means the same as unset
    with prefer("triton"):
        r = backend(p)
        assert r[0] and r[1].backend == "triton"
    assert backend.stats["misses"] == 4


THD = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal", window_size=(-1, 0))


def test_token_counts_key_the_memo_by_their_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's num_tokens_q/kv reach the config as TE's bucket; calls in one bucket share one
    decision (a memo hit), calls in different buckets are decided separately (here a verdict that
    depends on the bucket: a stand-in rule refusing more than 1024 tokens)."""
    from te_fl_attention.probes.fused import probe as fused_probe
    from te_fl_attention.probes.fused import table as fused_table

    def over_1024(c: FusedAttnConfig, d: Any) -> Any:
        """Refuses a thd q above TE's first token bucket (a test stand-in, not TE's)."""
        if (c.num_tokens_q or 0) > 1024:
            return fused_table._t("test_tokens", "more than 1024 tokens", c.num_tokens_q, "<= 1024")
        return None

    rules = (*fused_table.TABLE_RULES, over_1024)
    monkeypatch.setattr(fused_table, "TABLE_RULES", rules)  # read by the TE stub
    monkeypatch.setattr(fused_probe, "TABLE_RULES", rules)  # read by the probe
    backend = rules_backend()
    calls = [(300, True), (1000, False), (1024, False), (1025, True), (2048, False), (1500, False),
             (5000, True)]  # (tokens, a new decision expected)
    answers = {}
    for tokens, new in calls:
        misses = backend.stats["misses"]
        p = Params(**THD, num_tokens_q=tokens, num_tokens_kv=tokens)
        answers[tokens] = backend(p)
        assert backend.stats["misses"] == misses + new, tokens
        assert backend.decide(p).config.num_tokens_q == te_max_tokens(tokens)
    assert answers[300] == answers[1024] and answers[1025] == answers[2048] == answers[5000]
    assert answers[300][5][1] and not answers[1025][5][1]  # fused: one bucket yes, the next no
    # Another format: TE passes 0, and the config holds no token count.
    bshd = Params(num_tokens_q=0, num_tokens_kv=0)
    assert backend.decide(bshd).config.num_tokens_q is None


def test_token_bucket_is_tes() -> None:
    assert [te_backend.token_bucket(t) for t in (0, 1, 1024, 1025, 4096, 32768, 32769, 70000)] == \
        [0, 1024, 1024, 2048, 4096, 32768, 65536, 98304]  # fmt: skip


class _Sym:
    """A stand-in for a symbolic token count: it records what it is compared with."""

    def __init__(self, value: int) -> None:
        self.value, self.seen = value, []

    def __gt__(self, other: int) -> bool:
        self.seen.append(("gt", other))
        return self.value > other

    def __le__(self, other: int) -> bool:
        self.seen.append(("le", other))
        return self.value <= other


def test_traced_token_bucket_guards_on_bounds_only() -> None:
    """Under torch.compile a count is only compared with the bucket bounds (a recompile when
    the bucket changes, not when the count does)."""
    for value in (0, 1, 700, 1025, 5000, 32768):
        sym = _Sym(value)
        assert te_backend.traced_token_bucket(sym) == te_backend.token_bucket(value)
        assert {other for _, other in sym.seen} <= {0, 1024, 2048, 4096, 8192, 16384, 32768}
    assert te_backend.traced_token_bucket(3000) == 4096


def test_unhashable_and_fp8_params() -> None:
    backend = rules_backend()
    listed = backend(Params(window_size=[-1, 0]))  # TE may pass a list window
    assert listed == backend(Params())
    assert backend(Params(window_size=[-1, 0])) == listed

    class DelayedScaling:  # TE's recipe class name is what the config reads
        fp8_dpa, fp8_mha = True, False

    fp8 = backend(Params(fp8=True, fp8_meta={"recipe": DelayedScaling(), "group": object()},
                         head_dim_qk=128, head_dim_v=128))  # fmt: skip
    assert fp8[2] is True and fp8[3] == 2  # the FP8 sub-backend
    assert not fp8[5][0]  # no flash-tier backend takes FP8 on sm90 with FA2 only


def test_duck_typed_params_without_a_dataclass() -> None:
    ns = types.SimpleNamespace(**dataclasses.asdict(Params()))
    assert rules_backend()(ns) == rules_backend()(Params())


def test_env_defaults_mean_unset() -> None:
    defaults = env_defaults()
    assert {"NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "TE_FL_ATTN_FORCE"} <= \
        set(defaults)  # fmt: skip
    assert Policy.from_env(environ=defaults) == Policy.from_env(environ={})


class _FakeBackendEnum(enum.IntEnum):
    No_Backend = -1
    F16_arbitrary_seqlen = 1
    FP8 = 2


@pytest.mark.parametrize("te_version, table, want", [
    ("2.20.2", None, int),
    ("2.20.0.dev0", None, int),
    ("2.19.1", _FakeBackendEnum, _FakeBackendEnum),
    ("2.16.0", {"F16_arbitrary_seqlen": "pybind-1", "FP8": "pybind-2", "No_Backend": "pybind-"},
     str),
])  # fmt: skip
def test_fused_backend_type_follows_te(monkeypatch: pytest.MonkeyPatch, te_version: str,
                                       table: Any, want: type) -> None:
    monkeypatch.setattr(te_backend, "te_version", lambda: Version(te_version))
    fake = types.ModuleType("fused_attn")
    fake.FusedAttnBackend = table
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cpp_extensions.fused_attn", fake)
    value = rules_backend()(Params())[3]
    assert type(value) is want and int(value if want is not str else 1) == 1
    if want is str:
        assert value == "pybind-1"


# ---------------------------------------------------------------- representative shapes
def _with_sizes(c: FusedAttnConfig, b: int, sq: int, skv: int) -> FusedAttnConfig:
    alibi = c.alibi_slopes_shape
    if alibi is not None and len(alibi) == 2:
        alibi = (b, c.num_heads)
    return c.replace(batch_size=b, max_seqlen_q=sq, max_seqlen_kv=skv, alibi_slopes_shape=alibi)


def _random_configs(n: int, seed: int) -> list[FusedAttnConfig]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        h, hg = rng.choice([(16, 16), (16, 4), (8, 1), (2, 2)])
        kv = rng.random() < 0.15
        kw = dict(
            batch_size=rng.choice([1, 2, 3, 8, 64, 4096]),
            max_seqlen_q=rng.choice([1, 2, 100, 128, 256, 1000, 1024, 2048, 4096, 8192]),
            max_seqlen_kv=rng.choice([1, 100, 128, 256, 1024, 1025, 1280, 2048, 8192, 65536]),
            num_heads=h, num_gqa_groups=hg, head_dim_qk=rng.choice([64, 128, 192, 256]),
            dtype=rng.choice(["bf16", "fp16", "fp32"]),
            qkv_layout=rng.choice(["bshd_bshd_bshd", "sbhd_sbhd_sbhd", "thd_thd_thd",
                                   "paged_kv_bshd_bshd_bshd" if kv else "bshd_bshd_bshd"]),
            attn_mask_type=rng.choice(["no_mask", "causal", "padding_causal",
                                       "causal_bottom_right", "padding"]),
            window_size=rng.choice([None, None, (128, 0), (64, 64)]),
            bias_type=rng.choice(["no_bias", "no_bias", "post_scale_bias", "alibi"]),
            deterministic=rng.random() < 0.3, is_training=rng.random() < 0.7,
            dropout=rng.choice([0.0, 0.0, 0.1]), cuda_graph=rng.random() < 0.2,
            kv_cache=kv, page_size=256 if kv else 0,
        )  # fmt: skip
        if kw["bias_type"] == "post_scale_bias":
            kw["bias_shape"] = rng.choice(["1hss", "bhss", "b1ss", "11ss", "111s"])
        if kw["bias_type"] == "alibi" and rng.random() < 0.5:
            kw["alibi_slopes_shape"] = (kw["batch_size"], h)
        if "thd" in kw["qkv_layout"] or kv:
            kw["attn_mask_type"] = "padding_causal" if "causal" in kw["attn_mask_type"] \
                else "padding"  # fmt: skip
        try:
            out.append(FusedAttnConfig(**kw))
        except ValueError:
            continue
    return out


def _summary(selector: Selector, c: FusedAttnConfig, device: Any) -> tuple:
    d = selector.decide(c, device, Policy())
    fused = d.result("fused")
    return (d.chosen, d.available, d.detail.get("flash_variant"),
            fused.detail.get("sub_backend") if fused.supported else None)  # fmt: skip


@pytest.mark.parametrize("spec", ["a100", "h100:cudnn=9.14.0", "b200", "h100:cudnn=9.10.2"])
def test_representative_sizes_keep_every_verdict(spec: str) -> None:
    """The compiled path decides for a representative (batch, s_q, s_kv) with the same shape
    predicates; every verdict must be the one the real sizes get."""
    device, selector = profile(spec), Selector(default_probes(graph=False))
    for c in _random_configs(150, seed=sum(map(ord, spec))):  # (str hash is per process)
        tq, tkv = c.num_tokens_q or 0, c.num_tokens_kv or 0  # (kept as TE's buckets)
        preds = shape_predicates(c.batch_size, c.num_heads, c.max_seqlen_q, c.max_seqlen_kv,
                                 tq, tkv)  # fmt: skip
        b, sq, skv = representative(c.num_heads, preds, tq, tkv)
        rep = _with_sizes(c, b, sq, skv)
        assert _summary(selector, c, device) == _summary(selector, rep, device), (c, rep)


def test_representative_is_small_and_exact() -> None:
    preds = shape_predicates(7, 16, 768, 768)
    assert representative(16, preds) == (2, 256, 256)
    preds = shape_predicates(3, 16, 1, 4096)
    b, sq, skv = representative(16, preds)
    assert shape_predicates(b, 16, sq, skv) == preds and sq == 1 and skv % 256 == 0


# ------------------------------------------------------------ issue 12: what did my job run
def test_each_new_decision_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    backend = TEBackend(Selector(default_probes(graph=False)), "h100")
    with caplog.at_level(logging.INFO, "te_fl_attention"):
        backend(Params(qkv_dtype=torch.float32))
        backend(Params(qkv_dtype=torch.float32))  # a memo hit: no new line
        backend.clear()
        backend(Params(qkv_dtype=torch.float32))  # decided again: the same decision
        backend(Params())  # a new decision
    lines = [r for r in caplog.records if r.name == "te_fl_attention"]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines)
    first = lines[0].getMessage()
    assert "attention decision on h100:" in first and "for b=2 s_q=128" in first
    assert "refused: FusedAttention: qkv_dtype = fp32 is not supported" in first
    assert "FlashAttention 2: qkv_dtype = fp32" in first
    assert "FusedAttention for" in lines[1].getMessage()


def test_malformed_switch_fails_plugin_loading_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_FL_ATTN_SEED_ENV", "true")
    with pytest.raises(ValueError, match="TE_FL_ATTN_SEED_ENV='true' is not valid: expected "
                       "exactly 0 or 1"):  # fmt: skip
        te_backend.make_backend("h100", Selector(default_probes(graph=False)))


def test_representative_keeps_a_thd_bias_meeting_the_ragged_graph() -> None:
    """On TE's ragged graph (thd, sm90) a b1ss bias broadcasts only when its s_q is the token
    bucket: the representative size must keep that relation, and so the verdict."""
    device, selector = profile("h100"), Selector(default_probes(graph=False))
    for sq in (1024, 1000):
        c = FusedAttnConfig(batch_size=1, max_seqlen_q=sq, max_seqlen_kv=1024, num_heads=16,
                            qkv_layout="thd_thd_thd", attn_mask_type="padding_causal",
                            bias_type="post_scale_bias", bias_shape="b1ss", num_tokens_q=1024,
                            num_tokens_kv=1024)  # fmt: skip
        preds = shape_predicates(1, 16, sq, 1024, 1024, 1024)
        b, rq, rkv = representative(16, preds, 1024, 1024)
        assert (rq == 1024) == (sq == 1024)
        rep = _with_sizes(c, b, rq, rkv)
        assert _summary(selector, c, device) == _summary(selector, rep, device)
    fused = selector.decide(c, device, Policy()).result("fused")  # s_q 1000 != its bucket
    assert not fused.supported and fused.reasons[0].code == "cudnn_table.thd_bias_ragged"
