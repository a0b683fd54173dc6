"""Per-call cost of selection: a memo hit vs a full rule pass (every candidate's rules), and
the plugin's ``get_attention_backend`` on a repeated config vs TE's own cached path.

Prints one line each, as a ratio against the reference measured in the same run:
    select memo_hit_us=... full_rule_pass_us=... ratio=...
    select cache_hit_rule_check_us=... config_key_us=...

``memo_hit_us``: a selector deciding a (config, device, policy) it decided before (its memo).
``full_rule_pass_us``: a fresh selector (no store) deciding a NEW config object each time, equal
to the others (llama3-8b on h100, default policy; the objects are built outside the timed loop):
every candidate's rules are evaluated (``default_probes(graph=False)``: no cuDNN graph builds),
nothing is remembered from an earlier object (rule verdicts are memoized per config object
only), plus the policy filter and the ``Decision``. ``cache_hit_rule_check_us``: what a warm
store lookup adds per config: four cached rows (the candidates' results) held to this process's
rules (:func:`te_fl_attention.selector.narrow`) for a NEW config object each time.
``config_key_us``: ``FusedAttnConfig.key()`` on a new object (what every store lookup needs).
    te_plugin plugin_get_attention_backend_us=... te_cached_path_us=... ratio=... (target <= 0.25)

TE's cached path is what ``DotProductAttention.forward`` pays on every call when nothing changed:
building ``AttentionParams`` and comparing it (``!=``) with the stored one. It needs the
transformer-engine wheel (imported on CPU as in ``tests/probes/te_cpu.py``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from te_fl_attention import FusedAttnConfig, Policy, Selector  # noqa: E402
from te_fl_attention.device import profile  # noqa: E402
from te_fl_attention.presets import preset  # noqa: E402


def _median_us(fn, n: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def _te_comparison() -> str:
    """Our plugin's get_attention_backend on a repeated config vs TE's cached per-forward path,
    measured in alternating rounds (one run, same conditions)."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "probes"))
        import te_cpu
        import torch

        te = te_cpu.load()
    except Exception as exc:  # noqa: BLE001 - TE is optional here
        return f"te_plugin skipped: TransformerEngine cannot be imported ({exc})"
    from te_fl_attention.plugin import te as plugin
    from te_fl_attention.probes import default_probes

    utils = te.utils
    # DotProductAttention.forward's attention_params_kwargs for Llama 3 8B (sbhd, GQA 32/8).
    kw = dict(qkv_type=torch.Tensor, qkv_dtype=torch.bfloat16, qkv_layout="sbhd_sbhd_sbhd",
              num_heads=32, num_gqa_groups=8, max_seqlen_q=8192, max_seqlen_kv=8192,
              num_tokens_q=0, num_tokens_kv=0, head_dim_qk=128, head_dim_v=128, softcap=0.0,
              alibi_slopes_shape=None, core_attention_bias_type="no_bias",
              core_attention_bias_shape=None, core_attention_bias_requires_grad=False,
              attention_dropout=0.0, context_parallel=False, cp_comm_type="p2p", cp_size=1,
              cp_size_a2a=1, deterministic=False, is_training=True, fp8=False,
              fp8_meta={"fp8_checkpoint": False, "fp8_group": None}, inference_params=None,
              softmax_type="vanilla", return_max_logit=False, cuda_graph=False, num_splits=1,
              softmax_scale=128**-0.5, fp8_output=False, checkpoint_core_attention=False,
              has_score_mod=False, has_score_mod_bprop=False)  # fmt: skip
    per_call = dict(batch_size=2, attn_mask_type="causal", window_size=(-1, 0),
                    bottom_right_diagonal=False, pad_between_seqs=False)  # fmt: skip
    stored = utils.AttentionParams(**kw, **per_call)

    def te_cached() -> bool:
        return utils.AttentionParams(**kw, **per_call) != stored

    plugin.load_plugins(device="h100", selector=Selector(default_probes(graph=False)))
    try:
        ours = plugin.get_attention_backend
        assert ours(stored)[2] is True  # FusedAttention on sm90
        te_us, our_us = [], []
        for _ in range(9):  # alternate, so both see the same machine load
            te_us.append(_median_us(te_cached, 20000, rounds=1))
            our_us.append(_median_us(lambda: ours(stored), 20000, rounds=1))
    finally:
        plugin.uninstall()
    t, o = statistics.median(te_us), statistics.median(our_us)
    return (f"te_plugin plugin_get_attention_backend_us={o:.2f} te_cached_path_us={t:.2f} "
            f"ratio={o / t:.3f} (target <= 0.25)")


def _fresh_config(rules, device, policy, n: int = 300, rounds: int = 9
                  ) -> tuple[float, float, float]:  # fmt: skip
    """Median us per NEW config object of a full rule pass (a fresh selector's decide), of the
    cache-hit rule check (four cached rows narrowed) and of ``key()``, in alternating rounds;
    the config objects are built before each timed loop."""
    from te_fl_attention.selector import narrow

    spec = preset("llama3-8b")
    cached = Selector(rules).decide(FusedAttnConfig(**spec), device, policy).results
    pairs = tuple(zip(rules, cached, strict=True))
    full, check, key = [], [], []
    for _ in range(rounds):
        configs = [FusedAttnConfig(**spec) for _ in range(3 * n)]
        t0 = time.perf_counter()
        for c in configs[:n]:
            Selector(rules).decide(c, device, policy)
        t1 = time.perf_counter()
        for c in configs[n:2 * n]:
            for p, r in pairs:
                narrow(p, r, c, device)
        t2 = time.perf_counter()
        for c in configs[2 * n:]:
            c.key()
        t3 = time.perf_counter()
        full.append((t1 - t0) / n * 1e6)
        check.append((t2 - t1) / n * 1e6)
        key.append((t3 - t2) / n * 1e6)
    return statistics.median(full), statistics.median(check), statistics.median(key)


def main() -> None:
    device, policy = profile("h100"), Policy()
    cfg = FusedAttnConfig(**preset("llama3-8b"))
    from te_fl_attention.probes import default_probes

    rules = default_probes(graph=False)  # the rule pass alone (no cuDNN graph builds)
    hot = Selector(rules)
    hot.decide(cfg, device, policy)
    memo = _median_us(lambda: hot.decide(cfg, device, policy), 20000)
    full_us, check_us, key_us = _fresh_config(rules, device, policy)
    # What a TE forward pays on a repeated config: building the config from TE's parameters
    # plus the memo hit (the plugin path).
    rebuilt = _median_us(lambda: hot.decide(FusedAttnConfig(**preset("llama3-8b")), device,
                                            policy), 5000)  # fmt: skip
    env = _median_us(lambda: hot.decide(cfg, device, Policy.from_env()), 20000)
    print(f"select memo_hit_us={memo:.2f} full_rule_pass_us={full_us:.1f} "
          f"ratio={full_us / memo:.0f}x")
    print(f"select memo_hit_with_config_build_us={rebuilt:.2f} "
          f"memo_hit_with_env_policy_us={env:.2f} (vs full pass {full_us:.1f} us)")
    print(f"select cache_hit_rule_check_us={check_us:.1f} config_key_us={key_us:.1f} "
          "(target: full pass <= 30 us)")
    print(_te_comparison())


if __name__ == "__main__":
    main()
