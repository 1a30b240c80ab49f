"""Token ids on the wire and in buffers: big-endian uint32 `bytes`.

Why bytes and not `list[int]`: decoding a list of 512 ints creates 512 Python objects
(~14 KB); bytes are one 2 KB object. Big-endian fixed width makes byte order equal token
order, so `sorted(...)` on the bytes sorts prompts by token ids, and prefix comparisons
are memcmp slices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WIDTH = 4
_DTYPE = np.dtype(">u4")


def pack(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype=_DTYPE).tobytes()


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
