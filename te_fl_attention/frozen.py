"""Frozen dataclasses that are hashed often: :func:`hash_once`."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, TypeVar

_C = TypeVar("_C", bound=type)


def hash_once(cls: _C) -> _C:
    """Class decorator, above ``@dataclass(frozen=True)``: the instance's hash (the dataclass's
    own: the hash of its fields' values in order) is computed on first use and kept on the
    instance, since the fields never change. The selector's memos hash a config, device and
    policy several times per selection. The kept hash is left out of the pickled state: a
    string's hash differs from process to process (``PYTHONHASHSEED``)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.eq or "__slots__" in vars(cls):
        raise TypeError(f"hash_once needs a frozen dataclass with eq and an instance dict; "
                        f"{cls.__name__} is not one")  # fmt: skip
    if "__getstate__" in vars(cls):
        raise TypeError(f"hash_once would replace {cls.__name__}.__getstate__")
    # the fields the dataclass's own __hash__ covers, in order
    names = [f.name for f in dataclasses.fields(cls) if (f.compare if f.hash is None else f.hash)]
    values = operator.attrgetter(*names) if len(names) > 1 else (  # a tuple of their values
        lambda obj: tuple(getattr(obj, n) for n in names))  # fmt: skip

    def __hash__(self: Any) -> int:  # noqa: N807
        try:
            return self.__dict__["_hash"]  # type: ignore[no-any-return]
        except KeyError:
            h = hash(values(self))
            object.__setattr__(self, "_hash", h)
            return h

    def __getstate__(self: Any) -> dict[str, Any]:  # noqa: N807
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    cls.__hash__ = __hash__  # type: ignore[assignment]
    cls.__getstate__ = __getstate__  # type: ignore[attr-defined]
    return cls
