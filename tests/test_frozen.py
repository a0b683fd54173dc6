"""``hash_once``: the hash of a config, device or policy (the selector's memo keys) computed once,
exactly as the dataclass computes it, and never carried into another process."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys

import pytest

from te_fl_attention import FusedAttnConfig, Policy
from te_fl_attention.device import profile
from te_fl_attention.frozen import hash_once

MAKERS = {
    "config": lambda: FusedAttnConfig(num_heads=32, num_gqa_groups=8, dropout=0.1,
                                      attn_mask_type="causal", window_size=(128, 0)),
    "device": lambda: profile("h100"),
    "policy": lambda: Policy(fa3=False, prefer=("triton",)),
}  # fmt: skip


@pytest.mark.parametrize("kind", MAKERS)
def test_the_hash_is_the_fields_hash_computed_once(kind):
    a, b = MAKERS[kind](), MAKERS[kind]()
    fields_hash = hash(tuple(getattr(a, f.name) for f in dataclasses.fields(a)))
    assert hash(a) == fields_hash == hash(b) and a == b and {a: 1}[b] == 1
    object.__setattr__(a, "_hash", 12345)  # the kept value is what is returned
    assert hash(a) == 12345


def test_a_changed_copy_is_hashed_afresh():
    c = MAKERS["config"]()
    hash(c)
    changed = c.replace(num_heads=16)
    assert hash(changed) == hash(FusedAttnConfig(**{**c.to_dict(), "num_heads": 16}))
    assert hash(changed) != hash(c)
    dup = copy.deepcopy(c)
    assert hash(dup) == hash(c) and "_hash" not in pickle.loads(pickle.dumps(c)).__dict__


_CHILD = """
import pickle, sys
from te_fl_attention import FusedAttnConfig, Policy
from te_fl_attention.device import profile
got = pickle.loads(sys.stdin.buffer.read())
fresh = [FusedAttnConfig(num_heads=32, num_gqa_groups=8, dropout=0.1, attn_mask_type="causal",
                         window_size=(128, 0)), profile("h100"), Policy(fa3=False,
                         prefer=("triton",))]
print(all(hash(g) == hash(f) and {f: 1}.get(g) == 1 for g, f in zip(got, fresh)))
"""


def test_an_object_pickled_after_hashing_is_hashed_afresh_in_another_process():
    """A string's hash differs between processes: a kept hash carried by pickle would make an
    unpickled config miss every memo entry of an equal config in the other process."""
    objs = [make() for make in MAKERS.values()]
    assert all(isinstance(hash(o), int) for o in objs)
    for seed in ("1", "2"):  # two seeds: at least one differs from this process's
        out = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(objs),
                             capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})  # fmt: skip
        assert out.stdout.split() == [b"True"], out.stderr.decode()[-2000:]


def _shapes() -> list[type]:
    """Frozen dataclasses of each shape the hash must cover: no field, one, fields left out of
    the hash (``compare=False``, ``hash=False``) or put in (``hash=True``)."""

    @dataclasses.dataclass(frozen=True)
    class Zero:
        pass

    @dataclasses.dataclass(frozen=True)
    class One:
        x: str = "a"

    @dataclasses.dataclass(frozen=True)
    class Some:
        x: int = 1
        y: int = dataclasses.field(default=2, compare=False)
        z: int = dataclasses.field(default=3, hash=False)
        w: int = dataclasses.field(default=4, compare=False, hash=True)

    return [Zero, One, Some]


@pytest.mark.parametrize("index", range(3))
def test_the_hash_is_the_dataclass_hash_for_every_field_shape(index):
    plain = _shapes()[index]()
    expected = hash(plain)  # the dataclass's own __hash__ (before the class is decorated)
    kept = hash_once(type(plain))()
    assert hash(kept) == expected and kept.__dict__["_hash"] == expected


def test_only_frozen_dataclasses_with_equality_and_an_instance_dict():
    @dataclasses.dataclass
    class Mutable:
        x: int = 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        x: int = 0

    class Plain:
        pass

    for cls in (Mutable, Slotted, Plain):
        with pytest.raises(TypeError, match="frozen dataclass"):
            hash_once(cls)
