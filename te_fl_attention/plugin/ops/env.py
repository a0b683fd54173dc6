"""Parsing of ``TE_FL_*`` values: a choice among names, comma lists, booleans."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")


def choice(where: str, value: str, allowed: Iterable[str]) -> str:
    norm = value.strip().lower()
    allowed = tuple(allowed)
    if norm not in allowed:
        raise ValueError(f"{where}={value!r} is not valid: expected one of {', '.join(allowed)}")
    return norm


def split(text: str, sep: str = ",") -> list[str]:
    return [part.strip() for part in text.split(sep) if part.strip()]


def parse_bool(environ: Mapping[str, str], var: str) -> bool:
    raw = environ.get(var, "")
    norm = raw.strip().lower()
    if norm in TRUE or norm in FALSE:
        return norm in TRUE
    raise ValueError(f"{var}={raw!r} is not valid: expected one of {', '.join(TRUE + FALSE[1:])}")
