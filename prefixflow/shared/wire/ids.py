"""A set of prompt ids whose memory stays small whatever the ids are.

Ids keep their type: 5 and "5" are two ids (a job may be given both, and each comes out
as its own row); a restarted sink reads each id back with its type (an id column widened
to text records which rows held integers: `prefixflow/services/sink/growth.py`). Two
representations, both compact:

- Integer ids in [0, 2^62) live in a chunked bitmap:
  8 KiB per 65,536 consecutive ids, so a 200k-row job's dedupe memory is ~32 KiB
  instead of ~15 MB of Python objects.
- Any other id is kept as a 12-byte blake2b digest of its UTF-8 text (an integer's text
  behind a 0xFF byte, which no UTF-8 text holds, so -1 and "-1" differ), in a sorted numpy
  array (`S12`) plus a small Python set of digests added since the last merge (merged in
  batches once it holds 1/32 of the array), and a small set of discarded digests still
  in the array. That is ~12-13 bytes per id (a Python set of str took ~90-130 bytes per
  id), e.g. ~125 MB instead of ~1.2 GB for a 10M-row job with string ids.

NOTE: a digest is not the id: two different ids with one digest would be taken for one,
and the second one's row dropped as a duplicate. The digest keeps 95 bits (the lowest bit
of its last byte is forced to 1 so numpy never strips a trailing NUL), so for n ids the
odds of any collision are about n^2 / 2^96: ~1e-15 for 10M ids, ~1e-11 for 1 billion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
MAX_INT_ID = 1 << 62
DIGEST = np.dtype("S12")
MIN_MERGE = 4096
"""Digests buffered in a Python set before they are merged into the sorted array (or
1/32 of the array, whichever is more: the merges cost O(n) each, ~32 n bytes copied in
all, and the buffer stays under ~3 bytes per id)."""


INT_TAG = b"\xff"
"""Before an integer id's text in its digest (0xFF is no byte of any UTF-8 text)."""


def _as_int(pid: object) -> int | None:
    if isinstance(pid, int) and not isinstance(pid, bool):
        return pid if 0 <= pid < MAX_INT_ID else None
    return None


def digest(pid: object) -> bytes:
    """The 12-byte key of an id outside the bitmap: blake2b of its text (an integer's
    behind `INT_TAG`), last byte odd (so it has no trailing NUL, which numpy's `S12`
    would strip)."""
    data = str(pid).encode("utf-8", "surrogatepass")
    if isinstance(pid, int) and not isinstance(pid, bool):
        data = INT_TAG + data
    d = hashlib.blake2b(data, digest_size=12).digest()
    return d[:11] + bytes((d[11] | 1,))


class IdSet:
    def __init__(self) -> None:
        self._chunks: dict[int, bytearray] = {}
        self._sorted = np.empty(0, DIGEST)
        """Digests of non-integer ids, sorted (may hold discarded ones: `_gone`)."""
        self._new: set[bytes] = set()
        """Digests added since the last merge (never in `_sorted`)."""
        self._gone: set[bytes] = set()
        """Digests in `_sorted` that were discarded since (dropped at the next merge)."""
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def nbytes(self) -> int:
        """About how much memory the set holds (the bitmap, the array, the buffers)."""
        return CHUNK // 8 * len(self._chunks) + self._sorted.nbytes + 80 * (len(self._new) + len(self._gone))

    # -- digests ---------------------------------------------------------------------------

    def _in_sorted(self, key: bytes) -> bool:
        arr = self._sorted
        if not len(arr):
            return False
        i = arr.searchsorted(key)
        return i < len(arr) and arr[i] == key

    def _has_digest(self, key: bytes) -> bool:
        return key in self._new or (key not in self._gone and self._in_sorted(key))

    def _add_digest(self, key: bytes) -> bool:
        if key in self._new:
            return False
        if key in self._gone:
            self._gone.discard(key)
            return True
        if self._in_sorted(key):
            return False
        self._new.add(key)
        if len(self._new) >= max(MIN_MERGE, len(self._sorted) >> 5):
            self._merge()
        return True

    def _merge(self) -> None:
        """Fold the buffered digests into the sorted array and drop the discarded ones."""
        arr = self._sorted
        if self._gone:
            gone = np.array(sorted(self._gone), DIGEST)
            keep = np.ones(len(arr), bool)
            keep[np.searchsorted(arr, gone)] = False
            arr = arr[keep]
        if self._new:
            new = np.sort(np.array(list(self._new), DIGEST))
            arr = np.insert(arr, np.searchsorted(arr, new), new)
        # NOTE: the array first, then the buffers: a reader in between sees each id once
        self._sorted = arr
        self._gone = set()
        self._new = set()

    def _update_digests(self, keys: list[bytes]) -> None:
        """Add many digests at once (vectorized: a restart reading back millions)."""
        if len(keys) < MIN_MERGE:
            for key in keys:
                self._len += self._add_digest(key)
            return
        self._merge()  # now `_new` and `_gone` are empty
        new = np.unique(np.array(keys, DIGEST))
        arr = self._sorted
        if len(arr):
            pos = np.searchsorted(arr, new)
            present = arr[np.minimum(pos, len(arr) - 1)] == new
            new, pos = new[~present], pos[~present]
        else:
            pos = np.zeros(len(new), np.intp)
        self._sorted = np.insert(arr, pos, new)
        self._len += len(new)

    # -- the set ---------------------------------------------------------------------------

    def __contains__(self, pid: object) -> bool:
        n = _as_int(pid)
        if n is None:
            return self._has_digest(digest(pid))
        chunk = self._chunks.get(n >> CHUNK_BITS)
        bit = n & (CHUNK - 1)
        return chunk is not None and bool(chunk[bit >> 3] & (1 << (bit & 7)))

    def add(self, pid: object) -> bool:
        """Add; False if it was already there."""
        n = _as_int(pid)
        if n is None:
            if not self._add_digest(digest(pid)):
                return False
        else:
            chunk = self._chunks.get(n >> CHUNK_BITS)
            if chunk is None:
                chunk = self._chunks[n >> CHUNK_BITS] = bytearray(CHUNK // 8)
            bit = n & (CHUNK - 1)
            mask = 1 << (bit & 7)
            if chunk[bit >> 3] & mask:
                return False
            chunk[bit >> 3] |= mask
        self._len += 1
        return True

    def discard(self, pid: object) -> None:
        n = _as_int(pid)
        if n is None:
            key = digest(pid)
            if key in self._new:
                self._new.discard(key)
                self._len -= 1
            elif key not in self._gone and self._in_sorted(key):
                self._gone.add(key)
                self._len -= 1
                if len(self._gone) >= max(MIN_MERGE, len(self._sorted) >> 5):
                    self._merge()
            return
        chunk = self._chunks.get(n >> CHUNK_BITS)
        bit = n & (CHUNK - 1)
        if chunk is not None and chunk[bit >> 3] & (1 << (bit & 7)):
            chunk[bit >> 3] &= ~(1 << (bit & 7)) & 0xFF
            self._len -= 1

    def update(self, ids: Iterable[object] | np.ndarray) -> None:
        """Add every id. A numpy integer array (a Parquet id column) is added a bitmap
        chunk at a time; other ids in batches."""
        if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
            self._update_ints(ids)
            return
        keys: list[bytes] = []
        for pid in ids:
            if _as_int(pid) is None:
                keys.append(digest(pid))
            else:
                self.add(pid)
        self._update_digests(keys)

    def _update_ints(self, values: np.ndarray) -> None:
        values = np.unique(values)
        inside = (values >= 0) & (values < MAX_INT_ID)
        for pid in values[~inside].tolist():  # negative ids: digests
            self.add(pid)
        values = values[inside].astype(np.int64)
        chunk_of = values >> CHUNK_BITS
        starts = np.flatnonzero(np.r_[True, chunk_of[1:] != chunk_of[:-1]]) if len(values) else []
        for lo, hi in zip(starts, [*starts[1:], len(values)]):
            c = int(chunk_of[lo])
            chunk = self._chunks.get(c)
            if chunk is None:
                chunk = self._chunks[c] = bytearray(CHUNK // 8)
            mask = np.zeros(CHUNK, bool)
            mask[values[lo:hi] & (CHUNK - 1)] = True
            bits = np.packbits(mask, bitorder="little")
            have = np.frombuffer(chunk, np.uint8)
            self._len += int(np.bitwise_count(bits & ~have).sum())
            have |= bits

    def __eq__(self, other: object) -> bool:
        if isinstance(other, set | frozenset):
            return len(self) == len(other) and all(x in self for x in other)
        return NotImplemented
