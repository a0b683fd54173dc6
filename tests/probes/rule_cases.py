"""Helpers for the per-rule tests: run one rule on one (config, device) and check its verdict.

A case is ``(rule name, config kwargs, device spec, expected code or None)``. The rule is looked
up by ``__name__`` in the module's rule tuples; a refusal must carry the expected code, a message,
a limit and (unless it reports an absence) an observed value, and the candidate's probe must
report the same code, so the rule is known to be wired into its probe.

The kwargs may hold ``FORCE: {field: value}``: values set on the config *after* validation, for
what TE can hand its C++ query but a validated config never holds (a rule that guards it still
needs a refusing case).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes.base import Rule
from te_fl_attention.probes.common import ALL_BACKENDS

Case = tuple[str, dict[str, Any], str, "str | None"]

#: Codes that report something missing: their ``observed`` is ``None`` by meaning.
ABSENCE_CODES = frozenset({
    "device.no_gpu", "fused.cudnn_missing", "fa2.not_installed", "fa3.not_installed",
    "fa4.not_installed", "triton.not_installed", "triton.kernel_missing",
})  # fmt: skip

#: Rules every probe shares (tested once, in test_rules_common.py).
SHARED_NAMES = frozenset({r.__name__ for r in ALL_BACKENDS} | {"requires_gpu"})


def by_name(rules: Iterable[Rule]) -> dict[str, Rule]:
    """name -> rule; names must be unique inside one module's rule set."""
    out: dict[str, Rule] = {}
    for rule in rules:
        if rule.__name__ in out and out[rule.__name__] is not rule:
            raise AssertionError(f"two different rules are named {rule.__name__!r}")
        out[rule.__name__] = rule
    return out


def case_id(case: Case) -> str:
    name, _, spec, code = case
    return f"{name}[{spec}]->{code or 'ok'}"


#: The kwargs key of the fields set after validation (see the module docstring).
FORCE = "_force"


def make_config(kw: dict[str, Any]) -> FusedAttnConfig:
    """The case's config: validated from ``kw``, then the ``FORCE`` fields set as given."""
    kw = dict(kw)
    forced = kw.pop(FORCE, {})
    config = FusedAttnConfig(**kw)
    for field, value in forced.items():
        assert hasattr(config, field), f"{field!r} is not a config field"
        object.__setattr__(config, field, value)
    return config


def check(rules: dict[str, Rule], case: Case, probe_codes: Callable[..., set[str]]) -> None:
    """Run ``case``'s rule and check its verdict (see the module docstring)."""
    name, kw, spec, code = case
    rule = rules[name]
    config, device = make_config(kw), profile(spec)
    reason = rule(config, device)
    if code is None:
        assert reason is None, f"{name} refused {kw} on {spec}: {reason}"
        return
    assert reason is not None, f"{name} accepted {kw} on {spec}; expected {code}"
    assert reason.code == code, f"{name}: got {reason.code} ({reason.message}), expected {code}"
    assert reason.message, f"{code}: empty message"
    assert reason.limit is not None, f"{code}: limit not set"
    if code not in ABSENCE_CODES:
        assert reason.observed is not None, f"{code}: observed not set"
    assert reason.stage in ("rule", "import"), reason.stage
    codes = probe_codes(config, device)
    assert code in codes, f"{code} is not reported by the probe (got {sorted(codes)})"


def assert_covered(rules: dict[str, Rule], cases: Sequence[Case], skip: Iterable[str] = ()) -> None:
    """Every rule has at least one accepting and one refusing case."""
    accepted = {c[0] for c in cases if c[3] is None}
    refused = {c[0] for c in cases if c[3] is not None}
    wanted = set(rules) - set(skip)
    missing = {n: [k for k, s in (("accept", accepted), ("refuse", refused)) if n not in s]
               for n in wanted}  # fmt: skip
    missing = {n: v for n, v in missing.items() if v}
    assert not missing, f"rules without cases: {missing}"
    unknown = (accepted | refused) - set(rules)
    assert not unknown, f"cases name unknown rules: {sorted(unknown)}"


def result_codes(result: Any) -> set[str]:
    """Every reason code in a probe result, its variants' included."""
    codes = {r.code for r in result.reasons}
    for v in result.variants:
        codes |= {r.code for r in v.reasons}
    return codes
