"""The compact row layout (store schema 2, pack format 2): each distinct result stored once.

A probe result's JSON text with its plain ``elapsed_ms`` values masked is its *template*, stored
once in ``templates`` under a 63-bit id hashed from its text (:func:`text_id`: the same id in
every store and pack, so rows copy between them without renumbering, and a template whose text
does not hash to its id is damaged). A row holds its template's id and the masked values: the
first is the row's ``elapsed_ms`` column, the others ``e1``..``e3``. A config is stored as the
fields that differ from a *base* (the defaults of some package version's ``FusedAttnConfig``),
stored once in ``bases`` under the id of its text.

A row or config that would not be rebuilt byte for byte (an ``elapsed_ms`` written otherwise,
more than :data:`HOLES` values, a config with other fields than the base) is stored in full, as
in schema 1 (``rid``/``base`` NULL): rows of a schema-1 store stay as they are.

A compact row's checksum (:func:`compact_crc`) covers its key (its context as the context's id)
and its compact columns; its template is checked against its id.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from .rows import crc_head, dumps

#: ``elapsed_ms`` values a row holds: its ``elapsed_ms`` column, then ``e1``..``e3``.
HOLES = 4
#: A plain ``elapsed_ms`` value (no sign or exponent, as ``repr(float)`` writes those in range).
ELAPSED = re.compile(rb'"elapsed_ms":(?:0|[1-9][0-9]{0,8})(?:\.[0-9]{1,20})?(?=[,}])')
MASK = b'"elapsed_ms":0'
#: A masked value in a template (where :data:`ELAPSED` matched in the full text).
HOLE = re.compile(rb'"elapsed_ms":0(?=[,}])')
_PREFIX = len(b'"elapsed_ms":')
NUMBERS = struct.Struct("<qqdddd").pack
#: A value column past a template's holes, in the checksum.
_NONE = -1.0


def text_id(data: bytes) -> int:
    """The 63-bit id of a template's or base's UTF-8 text."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


class Template(NamedTuple):
    """A ``templates`` row: the masked text of a result and what every row of it shares."""

    rid: int
    backend: str
    supported: int
    stage: str
    holes: int
    text: str


def split_result(text: str, backend: str, supported: int, stage: str, elapsed: float
                 ) -> tuple[Template, float | None, float | None, float | None] | None:  # fmt: skip
    """The template of a result's text and its values past the first (``None`` past the
    template's holes); ``None`` when the text is kept in full (its first value is not
    ``elapsed``, a value not as ``repr`` writes it, too many values)."""
    data = text.encode()
    values = [m[0][_PREFIX:] for m in ELAPSED.finditer(data)]
    if not 1 <= len(values) <= HOLES:
        return None
    floats = [float(v) for v in values]
    # (repr: -0.0 == 0.0, but the row would give back "-0.0")
    if repr(elapsed).encode() != values[0] or any(repr(f).encode() != v
                                   for f, v in zip(floats, values, strict=True)):  # fmt: skip
        return None
    masked = ELAPSED.sub(MASK, data)
    known = (masked, backend, supported, stage)
    template = _TEMPLATES.get(known, False)
    if template is False:
        # The masked text must give back every byte (checked once per template).
        template = None
        if expand(pieces(masked), *floats, *[None] * (HOLES - len(floats))) == data:
            template = Template(text_id(masked), backend, supported, stage, len(floats),
                                masked.decode())  # fmt: skip
        if len(_TEMPLATES) >= 4096:
            _TEMPLATES.clear()
        _TEMPLATES[known] = template
    if template is None:
        return None
    rest = floats[1:] + [None] * (HOLES - len(floats))
    return template, rest[0], rest[1], rest[2]


_TEMPLATES: dict[tuple[bytes, str, int, str], Template | None] = {}


def pieces(template: bytes) -> list[bytes]:
    """A template cut at its holes, each piece but the last ending with the hole's name."""
    cut = HOLE.split(template)
    glue = MASK[:-1]
    return [p + glue for p in cut[:-1]] + cut[-1:]


def expand(parts: list[bytes], elapsed: float, e1: Any, e2: Any, e3: Any) -> bytes | None:
    """A result's UTF-8 text from its template's :func:`pieces` and its values; ``None`` if the
    values do not fill the holes exactly (a damaged row)."""
    holes = len(parts) - 1
    values = (elapsed, e1, e2, e3)
    if holes < 1 or holes > HOLES:
        return None
    out = [parts[0]]
    for i in range(holes):
        v = values[i]
        if type(v) is not float:
            return None
        out.append(repr(v).encode())
        out.append(parts[i + 1])
    if any(v is not None for v in values[holes:]):
        return None
    return b"".join(out)


def compact_crc(config_key: str, backend: str, ctx: int, rid: int, elapsed: float, e1: Any,
                e2: Any, e3: Any) -> int:  # fmt: skip
    """A compact row's checksum: over its config key and backend (as :func:`.rows.crc_head`),
    then its context id, template id and values packed (:func:`numbers`). ``ValueError`` for
    values of other types (a damaged row: text or a blob in a REAL column)."""
    try:
        packed = numbers(ctx, rid, elapsed, e1, e2, e3)
    except struct.error as exc:
        raise ValueError(f"not a compact row's values ({exc})") from None
    return zlib.crc32(packed, crc_start(config_key, backend))


def crc_start(config_key: str, backend: str) -> int:
    """The checksum of a compact row's key part (a bulk check computes it once per key)."""
    return zlib.crc32(f"{backend}\0".encode(), zlib.crc32(crc_head(config_key)))


def numbers(ctx: int, rid: int, elapsed: float, e1: Any, e2: Any, e3: Any) -> bytes:
    """The compact columns as :func:`compact_crc` covers them."""
    return NUMBERS(ctx, rid, elapsed, _NONE if e1 is None else e1, _NONE if e2 is None else e2,
                    _NONE if e3 is None else e3)  # fmt: skip


# ------------------------------------------------------------------------------------- configs
@functools.lru_cache(maxsize=1)
def default_base() -> tuple[int, str, dict[str, Any]]:
    """This package's base: ``FusedAttnConfig()``'s fields (id, text, fields)."""
    from ..config import FusedAttnConfig

    fields = FusedAttnConfig().to_dict()
    text = dumps(fields)
    return text_id(text.encode()), text, fields


def split_config(config: Mapping[str, Any], text: str) -> tuple[int, str, str] | None:
    """``(base id, base text, the fields that differ as JSON)`` for a config (``text``: its JSON),
    or ``None`` when it is kept in full (other fields than the base, or not rebuilt exactly)."""
    bid, base_text, base = default_base()
    if len(config) != len(base) or list(config) != list(base):
        return None
    diff = {k: v for k, v in config.items() if base[k] != v or type(base[k]) is not type(v)}
    if dumps({**base, **diff}) != text:
        return None
    return bid, base_text, dumps(diff)


def join_config(base: Mapping[str, Any], diff: Mapping[str, Any]) -> dict[str, Any]:
    """A config from its base's fields and its own."""
    return {**base, **diff}
