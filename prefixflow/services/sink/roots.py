"""The sink's output roots: where jobs may write (`--out-root` / `PFX_OUT_ROOT`).

`PFX_OUT_ROOT` is one root or a comma-separated list of them: at most one local
directory (default: the sink's working directory) and any number of object store
prefixes (`s3://bucket/prefix/`, `gs://bucket/`). A job's local `out_dir` must resolve
under the local root (`confine`); an `s3://`/`gs://` one must be one of the URI roots or
below it (`store.confine_store`). No URI root listed: no job writes to an object store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prefixflow.shared.outputs import OutputLocationError, canonical, is_output_uri


class OutsideRoot(ValueError):
    """A job's `out_dir` resolves outside the sink's output root."""


@dataclass(frozen=True)
class Roots:
    local: Path
    """The local directory jobs write under (fully resolved)."""
    uris: tuple[str, ...] = ()
    """Object store prefixes jobs may write under (`outputs.canonical`)."""

    @classmethod
    def parse(cls, text: str) -> Roots:
        """`PFX_OUT_ROOT`'s value; `ValueError` for two local roots or a bad URI."""
        local: list[str] = []
        uris: list[str] = []
        for item in (t.strip() for t in (text or "").split(",")):
            if not item:
                continue
            if is_output_uri(item):
                try:
                    uris.append(canonical(item))
                except OutputLocationError as exc:
                    raise ValueError(f"--out-root: {exc}") from None
            else:
                local.append(item)
        if len(local) > 1:
            raise ValueError(f"--out-root: one local directory at most, got {local}")
        return cls(Path(os.path.realpath(local[0] if local else os.getcwd())), tuple(uris))

    def __str__(self) -> str:
        return ",".join([str(self.local), *self.uris])


def confine(root: str | Path, out_dir: str) -> Path:
    """Where to write a job whose spec says `out_dir`: the fully resolved directory
    (`..` folded, every symlink followed, a relative path taken under `root`), which
    must be `root` or inside it; else `OutsideRoot` with the reason.

    NOTE: this checks the path when the job is opened; a directory swapped for a symlink
    afterwards by someone with write access under the root is not caught (keep the root
    writable by the sink only)."""
    real_root = Path(os.path.realpath(root))
    if not out_dir or "\x00" in out_dir:
        raise OutsideRoot(f"invalid out_dir {out_dir!r}")
    path = Path(out_dir)
    real = Path(os.path.realpath(path if path.is_absolute() else real_root / path))
    if not real.is_relative_to(real_root):
        raise OutsideRoot(
            f"out_dir {out_dir!r} resolves to {str(real)!r}, outside the sink's output root "
            f"{str(real_root)!r} (--out-root / PFX_OUT_ROOT): job refused, nothing written"
        )
    return real
