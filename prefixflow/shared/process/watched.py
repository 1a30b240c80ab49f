"""A configuration file read again when it changes, without a restart (API keys, quotas).

`Watched.get()` compares the file's identity (inode, size, modification time in ns) with
the one it last read, a `stat` per call, so a change takes effect at the next request:
a key removed from the keys file is refused from then on. The file is parsed whole and
swapped in whole: an edit that does not parse keeps what was in force and logs why (an
error line naming the file, never its content). A file removed reads as empty (for the
keys file: its keys are revoked). At start a file that cannot be read or parsed is an
error (the service does not start).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger()

T = TypeVar("T")

MAX_BYTES = 1 << 20
"""Largest file read (a keys or quota file is a few KB; a larger one is refused)."""


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_text(path: Path) -> str:
    """The file's text (ValueError past MAX_BYTES)."""
    with path.open("rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path}: over {MAX_BYTES} bytes")
    return data.decode()


class Watched(Generic[T]):
    def __init__(self, path: str | os.PathLike, parse: Callable[[str], T], what: str) -> None:
        self.path, self.parse, self.what = Path(path), parse, what
        self.seen = _identity(self.path)
        self.value = parse(read_text(self.path))  # at start: an error stops the service
        self.reloads = 0

    def get(self) -> T:
        """The file's parsed content, read again if the file changed since."""
        now = _identity(self.path)
        if now != self.seen:
            self.seen = now
            try:
                self.value = self.parse(read_text(self.path) if now is not None else "")
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                log.error(f"{self.what} not reloaded: the one in force stays", path=str(self.path), error=str(exc))
            else:
                self.reloads += 1
                log.info(f"{self.what} reloaded", path=str(self.path))
        return self.value
