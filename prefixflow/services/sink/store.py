"""Where a job's output lives: a local directory or an object store prefix, behind one
small interface (`OutputStore`) that the writer (`writer.py`) and the binding
(`binding.py`) use. No NATS here.

- `LocalStore`: a directory on the sink's disk, exactly as before (`parts.py`: temporary
  names, fsync, rename; a merge hidden until its small parts are gone).
- `ObjectStore` (`objstore.py`): `s3://bucket/prefix/` or `gs://...` through pyarrow's
  file systems; each object one whole PUT, committed by the manifest beside the data
  (`prefixflow/shared/outputs.py`).

`open_store(location)` takes a local path or an output URI. `confine_store` is the
sink's output root rule for both: a local path under a local root (`writer.confine`), a
URI under one of the URI roots `PFX_OUT_ROOT` lists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from prefixflow.services.sink import parts as files
from prefixflow.services.sink.parts import Part, fsync_dir
from prefixflow.services.sink.roots import OutsideRoot, Roots, confine
from prefixflow.shared.outputs import OutputLocationError, canonical, is_output_uri, within
from prefixflow.shared.wire.subjects import API_NAMESPACE

__all__ = ["LocalStore", "OutputStore", "OutsideRoot", "Roots", "confine_store", "open_store"]


class OutputStore(Protocol):
    """A job's output location: its Parquet parts and the small files beside them."""

    where: str
    """The location as users see it (a path or a URI)."""
    local_dir: Path | None
    """The local directory (None: an object store)."""
    target_cap: int | None
    """The largest merged file this store takes in one write (None: no cap)."""

    def exists(self) -> bool: ...
    def recover(self) -> list[Part]: ...
    def scan(self) -> list[Part]: ...
    def write_part(self, table: pa.Table, n: int) -> Part: ...
    def write_empty(self, schema: pa.Schema | None, name: str) -> None: ...
    def merge(self, smalls: list[Part], schema: pa.Schema) -> Part: ...
    def rewrite(self, part: Part, schema: pa.Schema) -> None: ...
    def write_record(self, schema: pa.Schema) -> None: ...
    def data_bytes(self, part: Part) -> int: ...
    def source(self, part: Part) -> Any: ...
    def read_bytes(self, name: str) -> bytes | None: ...
    def put_bytes(self, name: str, data: bytes) -> None: ...
    def has_output(self, names: tuple[str, ...]) -> bool: ...
    def clear(self, globs: tuple[str, ...], dirs: tuple[str, ...], last: str) -> list[str]: ...


class LocalStore:
    """A job's output directory on the sink's disk (`parts.py`)."""

    target_cap = None

    def __init__(self, path: str | Path) -> None:
        self.local_dir = Path(path)
        self.where = str(self.local_dir)

    def exists(self) -> bool:
        return self.local_dir.is_dir()

    def prepare(self) -> None:
        self.local_dir.mkdir(parents=True, exist_ok=True)

    def recover(self) -> list[Part]:
        return files.recover(self.local_dir)

    def scan(self) -> list[Part]:
        return files.scan(self.local_dir)

    def write_part(self, table: pa.Table, n: int) -> Part:
        return files.write_part(table, self.local_dir, n)

    def write_empty(self, schema: pa.Schema | None, name: str) -> None:
        files.write_empty_part(self.local_dir, schema, name)

    def merge(self, smalls: list[Part], schema: pa.Schema) -> Part:
        return files.merge(smalls, self.local_dir, schema)

    def rewrite(self, part: Part, schema: pa.Schema) -> None:
        files.rewrite(part, schema)

    def write_record(self, schema: pa.Schema) -> None:
        files.write_record(self.local_dir, schema)

    def data_bytes(self, part: Part) -> int:
        return files.data_bytes(part.path)

    def source(self, part: Part) -> Path:
        return part.path

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return (self.local_dir / name).read_bytes()
        except FileNotFoundError:
            return None

    def put_bytes(self, name: str, data: bytes) -> None:
        """A small file, atomically (tmp, fsync, rename, fsync the directory)."""
        self.prepare()
        tmp = self.local_dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.local_dir / name)
        fsync_dir(self.local_dir)

    def has_output(self, names: tuple[str, ...]) -> bool:
        d = self.local_dir
        return any(True for _ in d.glob("*.parquet")) or any((d / n).exists() for n in names)

    def clear(self, globs: tuple[str, ...], dirs: tuple[str, ...], last: str) -> list[str]:
        """Delete the files matching `globs` and the folders `dirs`, then `last`."""
        out_dir, removed = self.local_dir, []
        for pattern in globs:
            for path in sorted(out_dir.glob(pattern)):
                if path.is_file() or path.is_symlink():
                    path.unlink()
                    removed.append(path.name)
        for name in dirs:
            path = out_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
                removed.append(name + "/")
            elif path.exists() or path.is_symlink():
                path.unlink()
                removed.append(name)
        fsync_dir(out_dir)  # the deletions are durable before the manifest goes
        if (out_dir / last).exists():
            (out_dir / last).unlink()
            removed.append(last)
        return removed


def open_store(location: str | Path | OutputStore) -> OutputStore:
    """The store of a local path or an output URI (a store is returned as it is)."""
    if isinstance(location, (str, Path)):
        if is_output_uri(str(location)):
            from prefixflow.services.sink.objstore import ObjectStore

            return ObjectStore(str(location))
        return LocalStore(location)
    return location


TENANT_MARK = ".pfx-tenant"
"""An empty file the sink puts in `<root>/<tenant>/` when it opens a tenant's job there:
that directory is the tenant's, and a job without a tenant may not write into it."""


def tenant_dir_of(root: Path, path: Path) -> str | None:
    """The tenant whose directory of the local root `path` lies in (the batch service's
    namespace, or a directory holding `TENANT_MARK`), or None."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return None
    if not parts:
        return None
    first = parts[0]
    return first if first == API_NAMESPACE or (root / first / TENANT_MARK).exists() else None


def mark_tenant_dir(base: Path) -> None:
    """`TENANT_MARK` in a tenant's directory (made if missing). Best effort: a disk that
    cannot take it (full, read-only) is the job's own output condition, met right after."""
    try:
        base.mkdir(parents=True, exist_ok=True)
        (base / TENANT_MARK).touch(exist_ok=True)
    except OSError:
        pass


def confine_store(roots: Roots, out_dir: str, tenant: str = "") -> OutputStore:
    """The store a job whose spec says `out_dir` writes to: a URI under one of the URI
    roots, or a local path under the local root (each with the tenant's own part of it;
    a job without a tenant not inside a tenant's directory, `tenant_dir_of`); else
    `OutsideRoot` with the reason."""
    if not is_output_uri(out_dir):
        if tenant:
            path = confine(roots.local / tenant, out_dir)
            mark_tenant_dir(roots.local / tenant)
            return LocalStore(path)
        path = confine(roots.local, out_dir)
        if (owner := tenant_dir_of(roots.local.resolve(), path)) is not None:
            raise OutsideRoot(f"out_dir {out_dir!r} is in tenant {owner!r}'s directory of the sink's output root: "
                              "a job without a tenant may not write there; job refused, nothing written")
        return LocalStore(path)
    try:
        uri = canonical(out_dir)
    except OutputLocationError as exc:
        raise OutsideRoot(f"out_dir {out_dir!r} refused: {exc}") from None
    allowed = [f"{r}/{tenant}" if tenant else r for r in roots.uris]
    if not any(within(uri, r) for r in allowed):
        shown = ", ".join(allowed) or "none (PFX_OUT_ROOT lists no s3:// or gs:// root)"
        raise OutsideRoot(f"out_dir {out_dir!r} is outside the sink's allowed output URIs ({shown}; "
                          "--out-root / PFX_OUT_ROOT): job refused, nothing written")
    return open_store(uri)
