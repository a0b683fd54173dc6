"""The uniform choice (fleet/uniform.py): the best backend supported on every device type."""

from __future__ import annotations

from fleet_testutil import LLAMA

from te_fl_attention import Policy
from te_fl_attention.fleet import common_choice, plan


def test_uniform_names_the_winner_and_why_the_others_lost(sel):
    u = plan([LLAMA], ["a100", "h100"], selector=sel).uniform()
    (name, choice), = u.items()
    assert name.startswith("32h/8kv d128")  # unnamed configs are described
    # fused is 3rd on sm80, flash is 2nd on sm90: flash's worst place wins
    assert (choice.chosen, choice.flash_variant) == ("flash", "fa2")
    assert choice.why[0].startswith("FlashAttention 2: supported on every device")
    assert any(w.startswith("FusedAttention: supported on every device but ranked lower")
               for w in choice.why)
    assert choice.per_device == {"a100": "FlashAttention 2", "h100": "FusedAttention"}


def test_uniform_needs_a_flash_flavour_common_to_every_device(sel):
    pol = Policy(fused=False, triton=False, unfused=False)
    devs = ["a100", "b200:fa2=none,fa4=4.0.0b36"]
    chosen, flavour, why = common_choice(
        {d: sel.decide(LLAMA, d, pol) for d in devs})
    assert chosen is None and flavour is None
    assert any("no FlashAttention flavour is supported on every device (a100: fa2; "
               "b200:fa2=none,fa4=4.0.0b36: fa4)" in w for w in why)
    u = plan([LLAMA], devs, policy=pol, selector=sel).uniform()
    assert next(iter(u.values())).label == "no backend"
