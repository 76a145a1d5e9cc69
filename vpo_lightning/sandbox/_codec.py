"""Plain-data codec shared by the trainer and the sandboxed child (tagged JSON, never pickle).

Imported by the parent as ``vpo_lightning.sandbox._codec`` and by the child as a top-level ``_codec`` module
copied into the sandbox; it uses only the standard library.
"""

from __future__ import annotations

import json as _json
from typing import Any

MAX_DEPTH = 200
# Distinct hashable values in one answer that may share a hash: more means a crafted collision flood (ints that
# differ by multiples of 2**61 - 1 all hash alike), which would make building a set or dict quadratic.
MAX_SHARED_HASH = 8


def encode(value: Any, _depth: int = 0) -> Any:
    """The tagged-JSON form of a plain-data value (raises ``TypeError`` on anything else)."""
    if _depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is int or t is float or t is str:
        return value
    if t is list:
        return [encode(v, _depth + 1) for v in value]
    if t is tuple:
        return {"t": [encode(v, _depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode(k, _depth + 1), encode(v, _depth + 1)] for k, v in value.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [encode(v, _depth + 1) for v in value]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real, value.imag]}
    raise TypeError(f"cannot pass a {t.__name__} value across the sandbox boundary")


class _Decoder:
    """Builds containers from tagged JSON, refusing hash-collision floods before any set or dict is built."""

    def __init__(self) -> None:
        self.hashes: dict[int, set[Any]] = {}

    def check(self, items: Any) -> None:
        for item in items:
            if type(item) in (int, float, complex, tuple, frozenset):
                same = self.hashes.setdefault(hash(item) & 0xFFFFFFFFFFFFFFFF, set())
                if len(same) >= MAX_SHARED_HASH and item not in same:
                    raise ValueError("too many distinct values with one hash")
                if len(same) < MAX_SHARED_HASH:
                    same.add(item)

    def tagged(self, obj: dict[str, Any]) -> Any:
        if len(obj) != 1:
            raise ValueError("malformed tagged value")
        ((tag, v),) = obj.items()
        if tag == "t":
            return tuple(v)
        if tag == "d":
            self.check(k for k, _ in v)
            return {k: x for k, x in v}  # noqa: C416 - dict(v) would pass a dict v unchecked
        if tag in ("s", "f"):
            self.check(v)
            return set(v) if tag == "s" else frozenset(v)
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "c":
            return complex(*v)
        raise ValueError(f"unknown tag {tag!r}")


def dumps(msg: Any) -> bytes:
    """One message (already :func:`encode`-d) as compact JSON bytes."""
    return _json.dumps(msg, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """The plain-data value of one message (raises ``ValueError`` on malformed or collision-flooding input)."""
    return _json.loads(data, object_hook=_Decoder().tagged)
