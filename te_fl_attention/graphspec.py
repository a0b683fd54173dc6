"""cuDNN graph specs: the graphs the fused probe builds, in cudnn-frontend's own JSON vocabulary.

A *spec* is what cudnn-frontend serializes for a graph (``str(graph)``; the same JSON it writes
to its log with ``CUDNN_FRONTEND_LOG_INFO=1``): ``context`` (data types), ``nodes`` (the SDPA
node: ``tag``, ``name``, its options, ``inputs`` / ``outputs`` mapping a role such as ``Q`` or
``dBias`` to a tensor ``uid``) and ``tensors`` (``uid``, ``name``, ``dim``, ``stride``,
``data_type``, ``ragged_offset_name``, ``is_pass_by_value``...). This module reads specs, lists
them by role (:func:`roles`), finds graphs in a cudnn-frontend log (:func:`graphs_in_log`) and
compares two graphs role by role (:func:`diff`), so that the graphs we build can be put beside the
ones TransformerEngine builds on a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

#: Node keys that are bookkeeping, not options (names and uids differ between builders).
_NODE_META = ("inputs", "outputs", "name", "tag")
#: Tensor fields compared by :func:`diff` (names and uids are the builder's choice).
TENSOR_FIELDS = ("dim", "stride", "data_type", "is_pass_by_value", "is_virtual",
                 "reordering_type", "ragged_offset_multiplier")  # fmt: skip

Spec = Mapping[str, Any]


def sdpa_node(spec: Spec) -> Mapping[str, Any] | None:
    """The graph's SDPA node (forward or backward, F16 or FP8), or ``None``."""
    for node in spec.get("nodes") or ():
        if str(node.get("tag", "")).startswith("SDPA"):
            return node
    return None


def options(spec: Spec) -> dict[str, Any]:
    """The SDPA node's options (every key but its name, tag and tensor maps) and the graph's
    data types."""
    node = sdpa_node(spec) or {}
    out = {k: v for k, v in node.items() if k not in _NODE_META}
    for k, v in (spec.get("context") or {}).items():
        if k.endswith("data_type"):
            out[f"context.{k}"] = v
    return out


def roles(spec: Spec) -> dict[str, dict[str, Any]]:
    """``{"in Q": tensor, "out dQ": tensor, ...}``: every tensor the SDPA node reads or writes,
    keyed by its role; a tensor's ragged offset is folded in as ``ragged_offset`` (the offset
    tensor's dims and data type, or ``None``)."""
    node = sdpa_node(spec) or {}
    by_uid = {t.get("uid"): t for t in spec.get("tensors") or ()}
    by_name = {t.get("name"): t for t in spec.get("tensors") or ()}
    out: dict[str, dict[str, Any]] = {}
    for side in ("inputs", "outputs"):
        for role, uid in sorted((node.get(side) or {}).items()):
            t = dict(by_uid.get(uid) or {})
            off = by_name.get(t.get("ragged_offset_name")) if t.get("ragged_offset_name") else None
            t["ragged_offset"] = None if off is None else {
                "dim": off.get("dim"), "data_type": off.get("data_type")}  # fmt: skip
            out[f"{'in' if side == 'inputs' else 'out'} {role}"] = t
    return out


def summary(spec: Spec) -> dict[str, Any]:
    """A compact, comparable form: the node's tag, options and tensors by role."""
    node = sdpa_node(spec) or {}
    return {"tag": node.get("tag"), "options": options(spec),
            "tensors": {role: {k: t.get(k) for k in (*TENSOR_FIELDS, "ragged_offset", "name")}
                        for role, t in roles(spec).items()}}  # fmt: skip


def diff(ours: Spec, theirs: Spec) -> list[str]:
    """Every difference between two graphs, as sentences (role or option, ours vs theirs);
    empty when they are the same graph up to tensor names and uids."""
    a, b = summary(ours), summary(theirs)
    out: list[str] = []
    if a["tag"] != b["tag"]:
        out.append(f"node: {a['tag']} vs {b['tag']}")
    for key in sorted(set(a["options"]) | set(b["options"])):
        x, y = a["options"].get(key), b["options"].get(key)
        if x != y:
            out.append(f"option {key}: ours {x!r}, theirs {y!r}")
    for role in sorted(set(a["tensors"]) | set(b["tensors"])):
        x, y = a["tensors"].get(role), b["tensors"].get(role)
        if x is None or y is None:
            out.append(f"tensor {role}: {'only theirs' if x is None else 'only ours'}")
            continue
        for field in (*TENSOR_FIELDS, "ragged_offset"):
            if x.get(field) != y.get(field):
                out.append(f"tensor {role} {field}: ours {x.get(field)!r}, "
                           f"theirs {y.get(field)!r}")  # fmt: skip
    return out


def signature(spec: Spec) -> tuple[Any, ...]:
    """What identifies the problem a graph is for (its SDPA tag and Q/K/V shapes and types):
    used to pair our graph with the one TE built for the same call."""
    r = roles(spec)
    return (str((sdpa_node(spec) or {}).get("tag")),
            *(json.dumps([(r.get(f"in {n}") or {}).get(k) for k in ("dim", "data_type")])
              for n in ("Q", "K", "V")))  # fmt: skip


def graphs_in_log(text: str) -> list[dict[str, Any]]:
    """Every graph JSON object found in a cudnn-frontend log (or any text): objects that hold
    ``nodes`` and ``tensors``, in the order they appear (duplicates kept)."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    i = text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and "nodes" in obj and "tensors" in obj:
            found.append(obj)
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)
    return found


def match(ours: Spec, candidates: Iterable[Spec]) -> tuple[Spec | None, list[str]]:
    """The candidate graph closest to ``ours`` (same signature first, then fewest differences)
    and the differences from it; ``(None, [...])`` when there is no candidate of the same
    signature."""
    want = signature(ours)
    same = [c for c in candidates if signature(c) == want]
    if not same:
        return None, [f"no graph with the signature {want}"]
    best = min(same, key=lambda c: len(diff(ours, c)))
    return best, diff(ours, best)


__all__ = ["TENSOR_FIELDS", "diff", "graphs_in_log", "match", "options", "roles", "sdpa_node",
           "signature", "summary"]
