"""Token ids on the wire and in buffers: big-endian uint32 `bytes`.

Why bytes and not `list[int]`: decoding a list of 512 ints creates 512 Python objects
(~14 KB); bytes are one 2 KB object. Big-endian fixed width makes byte order equal token
order, so `sorted(...)` on the bytes sorts prompts by token ids, and prefix comparisons
are memcmp slices.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

WIDTH = 4
_DTYPE = np.dtype(">u4")
assert array.array("I").itemsize == WIDTH, "packed token ids are 32-bit"


def pack(ids: Sequence[int]) -> bytes:
    """Pack token ids (raises ValueError unless every one is an int in [0, 2**32))."""
    packed = pack_checked(list(ids))
    if packed is None:
        raise ValueError("token ids must be integers in [0, 2**32)")
    return packed


def pack_checked(ids: Any) -> bytes | None:
    """`ids` packed, or None unless it is a list of integers in [0, 2**32) (user input).
    C loops only: `map(type)` rules out bools and floats, `array` checks the range as it
    fills."""
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        return None
    try:
        packed = array.array("I", ids)
    except (TypeError, OverflowError):
        return None
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=_DTYPE).tolist()


def max_id(data: bytes) -> int:
    """Largest token id in packed `data` (which holds at least one)."""
    return int(np.frombuffer(data, dtype=_DTYPE).max())


def count(data: bytes) -> int:
    return len(data) // WIDTH


def common_prefix(a: bytes, b: bytes) -> int:
    """Number of leading tokens `a` and `b` share (binary search over memcmp slices)."""
    lo, hi = 0, min(len(a), len(b)) // WIDTH
    if a[: hi * WIDTH] == b[: hi * WIDTH]:
        return hi
    while lo < hi:  # invariant: first lo tokens equal, first hi+1 tokens differ... narrow down
        mid = (lo + hi + 1) // 2
        if a[: mid * WIDTH] == b[: mid * WIDTH]:
            lo = mid
        else:
            hi = mid - 1
    return lo
