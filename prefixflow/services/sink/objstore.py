"""A job's output in an object store (`s3://bucket/prefix/`, `gs://...`): parts committed
by a manifest, since an object store has no rename. No NATS here.

Names under the prefix are those of a local output (`parts.py`): small parts
`part-000123.parquet`, merged files `part-000000-000099.parquet`, `_common_metadata`,
`_job.json`, `_summary.json`; and `_manifest.json`, the committed data files
(`prefixflow/shared/outputs.py`).

1. Every object is built whole in memory, then written: up to `SINGLE_PUT_BYTES` in one
   PUT (pyarrow's `allow_delayed_open`: one PutObject on close, no multipart upload); a
   larger one goes to `_pending.<name>.<random>` first (a multipart upload, which a crash may leave
   open or torn) and is then copied to its name by the server (CopyObject: whole or
   nothing). So an object under its own name is always complete.
2. A part is committed once the manifest names it: write the part, then the manifest.
3. A merge writes the merged file, then the manifest (the merged file in place of its
   small parts), then deletes the small parts.
4. On open (`recover`), what the manifest does not name is a crash's leftover: deleted,
   as are `_pending.*` objects, and open multipart uploads under the prefix are aborted (with
   boto3, when it is installed; without it, logged). Then only committed objects are there.

Merged files are capped at `OBJECT_TARGET_BYTES` so each is one PUT; the writer's
memory per merge is about that much, not the local writer's 128 MiB.
"""

from __future__ import annotations

import fnmatch
import json
import threading
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import structlog

from prefixflow.services.sink import parts as files
from prefixflow.services.sink.parts import PART_NAME, Part, merged_name, small_name
from prefixflow.shared.outputs import FILES_MANIFEST, canonical, filesystem
from prefixflow.shared.widening import conform

log = structlog.get_logger()

SINGLE_PUT_BYTES = 8 << 20
"""Objects up to this size are one PUT (under pyarrow's 10 MiB S3 upload part)."""
OBJECT_TARGET_BYTES = 6 << 20
"""Merged files in an object store hold about this many bytes of parts (one PUT each)."""
PENDING = "_pending"
"""The name prefix of an object too large for one PUT, uploaded before the server copies
it to its name (`_pending.<name>.<random>`: a `_` name, which readers skip)."""


def parquet_bytes(table: pa.Table) -> pa.Buffer:
    """A table as a Parquet file in memory."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue()


def _write(sink: pa.BufferOutputStream, tables: list[pa.Table], schema: pa.Schema) -> None:
    with pq.ParquetWriter(sink, schema) as writer:
        for table in tables:
            writer.write_table(table, row_group_size=max(table.num_rows, 1))


def rows_bytes(size: int, footer_length: bytes) -> int:
    """A Parquet file's size less its footer (`parts.data_bytes`), from its size and the
    4 bytes before its trailing magic."""
    return max(size - int.from_bytes(footer_length, "little") - 12, 0)


class ObjectStore:
    """A job's output under an object store prefix (see the module's doc)."""

    local_dir = None
    target_cap = OBJECT_TARGET_BYTES

    def __init__(self, uri: str, fs: pafs.FileSystem | None = None, base: str = "") -> None:
        """`fs` and `base`: another file system and path than the URI's (tests)."""
        self.where = canonical(uri)
        self.fs, self.base = (fs, base.rstrip("/")) if fs is not None else filesystem(uri)
        self.files: list[str] = []
        """The committed data files, in part order (the manifest's)."""
        self._lock = threading.Lock()  # a flush and a merge (two threads) both change `files`
        self._data_bytes: dict[str, int] = {}
        """`data_bytes` of the small parts written here (no request to ask the store)."""

    def _path(self, name: str) -> str:
        return f"{self.base}/{name}"

    def names(self) -> list[str]:
        """Names directly under the prefix (files and folders)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.base, allow_not_found=True))
        return sorted(i.base_name for i in infos)

    def exists(self) -> bool:
        return bool(self.names())

    def _put(self, name: str, data: pa.Buffer | bytes) -> None:
        """One whole object under `name` (see the module's doc, step 1)."""
        if len(data) <= SINGLE_PUT_BYTES:
            with self.fs.open_output_stream(self._path(name)) as stream:
                stream.write(data)
            return
        pending = self._path(f"{PENDING}.{name}.{uuid.uuid4().hex}")
        try:
            with self.fs.open_output_stream(pending) as stream:
                stream.write(data)
            self.fs.copy_file(pending, self._path(name))
        finally:
            try:
                self.fs.delete_file(pending)
            except OSError:
                pass  # NOTE: left for `recover`: a `_pending.*` object is not data (a `_` name)

    def _commit(self, files_now: list[str]) -> None:
        """Write the manifest naming `files_now` (the commit point), then keep it."""
        self._put(FILES_MANIFEST, (json.dumps({"files": files_now}) + "\n").encode())
        self.files = files_now

    def _delete(self, names: list[str]) -> None:
        for name in names:
            try:
                self.fs.delete_file(self._path(name))
            except FileNotFoundError:
                pass

    def recover(self) -> list[Part]:
        """The committed parts, after deleting a crash's leftovers (module doc, step 4)."""
        doc = self._read_json(FILES_MANIFEST) or {}
        present = set(self.names())
        listed = [n for n in doc.get("files", []) if isinstance(n, str)]
        committed = [n for n in listed if n in present]
        stray = [n for n in present if (PART_NAME.fullmatch(n) and n not in committed) or n.startswith(PENDING + ".")]
        self._delete(stray)
        aborted = self.abort_uploads()
        with self._lock:
            if committed != listed or (stray and not doc):
                self._commit(committed)
            self.files = committed
        if stray or aborted:
            log.info("object store output recovered", where=self.where, deleted=stray, aborted_uploads=aborted)
        return self.scan()

    def abort_uploads(self) -> int:
        """Abort multipart uploads left open under the prefix (S3, with boto3); how many."""
        if not isinstance(self.fs, pafs.S3FileSystem):
            return 0
        try:
            import boto3
        except ImportError:
            log.info("boto3 not installed: multipart uploads left by a crash are not aborted here", where=self.where)
            return 0
        bucket, _, prefix = self.base.partition("/")
        try:
            client = boto3.client("s3")  # NOTE: the same environment as pyarrow's (AWS_ENDPOINT_URL included)
            found = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/" if prefix else "").get("Uploads", [])
            for upload in found:
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        except Exception as exc:  # noqa: BLE001 - botocore's errors: open uploads are invisible to readers; tried next open
            log.warning("multipart uploads not aborted", where=self.where, error=repr(exc))
            return 0
        return len(found)

    def scan(self) -> list[Part]:
        found = []
        for name in self.files:
            if (m := PART_NAME.fullmatch(name)) is not None:
                first = int(m.group(1))
                found.append(Part(first, int(m.group(2) or first), self._path(name), m.group(2) is not None))
        return sorted(found, key=lambda p: (p.first, p.last))

    def write_part(self, table: pa.Table, n: int) -> Part:
        """Small part `n`: the object, then the manifest naming it."""
        name = small_name(n)
        data = parquet_bytes(table)
        self._put(name, data)
        self._data_bytes[name] = rows_bytes(len(data), data[-8:-4].to_pybytes())
        try:
            with self._lock:
                self._commit([*self.files, name])
        except BaseException:
            self._delete([name])  # not committed: not left for a reader to take
            raise
        return Part(n, n, self._path(name), False)

    def write_empty(self, schema: pa.Schema | None, name: str) -> None:
        self._put(name, parquet_bytes(files.empty_part_schema(schema).empty_table()))
        with self._lock:
            self._commit([*self.files, name])

    def merge(self, smalls: list[Part], schema: pa.Schema) -> Part:
        """The merged file, then the manifest, then the small parts go (module doc, step 3)."""
        first, last = smalls[0].first, smalls[-1].last
        name = merged_name(first, last)
        sources = [self.fs.open_input_file(p.path) for p in smalls]
        try:
            tables = [conform(pq.ParquetFile(src).read(), schema) for src in sources]
            sink = pa.BufferOutputStream()
            _write(sink, [pa.concat_tables(tables)], files._file_schema(schema, sources))
            data = sink.getvalue()
            del tables
        finally:
            for src in sources:
                src.close()
            files.release_memory()
        self._put(name, data)
        gone = {p.path.rsplit("/", 1)[1] for p in smalls}
        with self._lock:
            kept = [n for n in self.files if n not in gone]
            at = next((i for i, n in enumerate(self.files) if n in gone), len(self.files))
            self._commit(kept[:at] + [name] + kept[at:])
        self._delete(sorted(gone))
        return Part(first, last, self._path(name), True)

    def rewrite(self, part: Part, schema: pa.Schema) -> None:
        """The file under the job's final schema, replacing it (a PUT replaces whole)."""
        with self.fs.open_input_file(part.path) as src:
            table = conform(pq.ParquetFile(src).read(), schema)
            file_schema = files._file_schema(schema, [src])
        sink = pa.BufferOutputStream()
        _write(sink, [table], file_schema)
        self._put(part.path.rsplit("/", 1)[1], sink.getvalue())

    def write_record(self, schema: pa.Schema) -> None:
        from prefixflow.services.sink.growth import RECORD

        sink = pa.BufferOutputStream()
        pq.write_metadata(schema, sink)
        self._put(RECORD, sink.getvalue())

    def data_bytes(self, part: Part) -> int:
        if (known := self._data_bytes.pop(part.path.rsplit("/", 1)[1], None)) is not None:
            return known
        with self.fs.open_input_file(part.path) as f:
            size = f.size()
            return rows_bytes(size, f.read_at(4, size - 8))

    def source(self, part: Part) -> pafs.NativeFile:
        return self.fs.open_input_file(part.path)

    def _read_json(self, name: str) -> dict | None:
        raw = self.read_bytes(name)
        try:
            doc = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def read_bytes(self, name: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self._path(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put_bytes(self, name: str, data: bytes) -> None:
        self._put(name, data)

    def has_output(self, names: tuple[str, ...]) -> bool:
        present = self.names()
        return any(n.endswith(".parquet") for n in present) or any(n in present for n in names)

    def clear(self, globs: tuple[str, ...], dirs: tuple[str, ...], last: str) -> list[str]:
        """Delete the objects matching `globs` and `_pending.*`, the folders `dirs`, the
        manifest of files, then `last`."""
        present = self.names()
        doomed = sorted({n for n in present for g in globs if fnmatch.fnmatchcase(n, g)} - {last, FILES_MANIFEST})
        self._delete(doomed)
        doomed_pending = [n for n in present if n.startswith(PENDING + ".")]
        self._delete(doomed_pending)
        doomed += doomed_pending
        for name in dirs:
            if name in present:
                self.fs.delete_dir(self._path(name))
                doomed.append(name + "/")
        for name in (FILES_MANIFEST, last):
            if name in present:
                self._delete([name])
                doomed.append(name)
        with self._lock:
            self.files = []
        return doomed
