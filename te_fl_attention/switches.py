"""Environment switches, parsed in one place (imports only ``os`` and the backend registry).

* Our own ``TE_FL_ATTN_*`` on/off switches accept exactly the ASCII strings ``"0"`` and ``"1"``;
  anything else (``"2"``, ``"-1"``, ``"1 "``, ``"false"``, ``""``, the Arabic-Indic ``"١"``) is a
  ``ValueError`` naming the variable, the value and what is allowed.
* TE's ``NVTE_*`` switches are parsed exactly as TransformerEngine 2.20.2 parses them
  (``transformer_engine/pytorch/attention/dot_product_attention/utils.py``,
  ``get_attention_backend``): ``int(os.environ.get(name, "1"))``, truthy when non-zero. So
  ``" 1"``, ``"2"`` and ``"-1"`` mean on, ``"0"``/``"00"`` off, and ``"abc"`` or ``""`` raise
  (TE raises ``ValueError`` on them too). ``NVTE_UnfusedDPA_Emulate_FP8`` is on only when it is
  exactly ``"1"`` (TE compares the string).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Our on/off switches and their defaults (what unset means).
SWITCHES: dict[str, str] = {
    "TE_FL_ATTN_TRITON": "1",
    "TE_FL_ATTN_VERIFY": "0",
    "TE_FL_ATTN_MEASURE": "0",
    "TE_FL_ATTN_CUDNN_PROBE": "1",
    "TE_FL_ATTN_CACHE_READONLY": "0",
    "TE_FL_ATTN_SEED_ENV": "1",
}

#: TE's integer switches (``int(os.environ.get(name, default))``) and their defaults.
NVTE_INT_SWITCHES: dict[str, str] = {
    "NVTE_FLASH_ATTN": "1",
    "NVTE_FLASH_ATTN_V2": "1",
    "NVTE_FLASH_ATTN_V3": "1",
    "NVTE_FLASH_ATTN_V4": "1",
    "NVTE_FUSED_ATTN": "1",
    "NVTE_UNFUSED_ATTN": "1",
}


def _shown(raw: str) -> str:
    """``repr`` of a raw value, shortened and with control characters escaped (by repr)."""
    text = ascii(raw)
    return text if len(text) <= 60 else text[:50] + f"...({len(raw)} chars)"


def switch(var: str, environ: Mapping[str, str] | None = None) -> bool:
    """One of our ``TE_FL_ATTN_*`` switches: ``"1"`` on, ``"0"`` off, unset its default;
    anything else raises ``ValueError``."""
    env = os.environ if environ is None else environ
    raw = env.get(var)
    default = SWITCHES.get(var, "1")  # a registered backend's own switch: on unless 0
    if raw is None:
        raw = default
    if raw == "1":
        return True
    if raw == "0":
        return False
    raise ValueError(f"{var}={_shown(raw)} is not valid: expected exactly 0 or 1 (ASCII, no "
                     f"spaces); unset means {default}")  # fmt: skip


def nvte_int(var: str, environ: Mapping[str, str] | None = None,
             default: str | None = None) -> bool:  # fmt: skip
    """A TE integer switch, as TE 2.20.2 reads it: ``bool(int(raw))``; what TE cannot read
    raises ``ValueError`` (TE raises too)."""
    env = os.environ if environ is None else environ
    raw = env.get(var)
    if raw is None:
        raw = NVTE_INT_SWITCHES.get(var, "1") if default is None else default
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{var}={_shown(raw)} is not valid: TransformerEngine 2.20.2 reads it "
                         "with int() and would raise too; expected an integer (0 off, "
                         "non-zero on)") from None  # fmt: skip


def nvte_emulate_fp8(environ: Mapping[str, str] | None = None) -> bool:
    """``NVTE_UnfusedDPA_Emulate_FP8``: on only when exactly ``"1"`` (TE's string compare)."""
    env = os.environ if environ is None else environ
    return env.get("NVTE_UnfusedDPA_Emulate_FP8", "0") == "1"


def check_switches(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` for the first of our switches that is set to anything but 0/1 (the
    CLI calls this first, so a bad value is exit 2 whichever module reads it)."""
    from . import backends

    env = os.environ if environ is None else environ
    ours = (*SWITCHES, *(v for v in backends.switch_vars() if not v.startswith("NVTE_")))
    for var in dict.fromkeys(ours):
        if var in env:
            switch(var, env)


__all__ = ["SWITCHES", "NVTE_INT_SWITCHES", "switch", "nvte_int", "nvte_emulate_fp8",
           "check_switches"]  # fmt: skip
