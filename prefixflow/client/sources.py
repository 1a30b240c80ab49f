"""Where a job's input is: a file, a directory, a glob or a URI, resolved to its shards.

An input is
- a file (`prompts.parquet`, `s3://bucket/prompts.jsonl`): one shard;
- a directory or a prefix (`shards/`, `s3://bucket/shards/`): its data files, recursively,
  in name order (of the path below the directory), skipping every file or folder whose
  name starts with `.` or `_` (`_SUCCESS`, `.crc` files, `_delta_log/`) the way
  `pyarrow.dataset` reads one, and files of no data format (`README.md`);
- a glob (`shards/*.parquet`, `s3://bucket/day=*/part-*.jsonl`, `**` for any depth): the
  data files it matches, in name order, hidden and `_` files skipped as above.

Data formats by suffix: Parquet (`.parquet`, `.pq`), JSON lines (`.jsonl`, `.ndjson`,
`.json`) and CSV (`.csv`); JSONL and CSV may be compressed (`.gz`, `.bz2`, `.zst`, `.lz4`:
read through pyarrow's compressed streams).

File systems are pyarrow's (`pyarrow.fs`): local paths and `file://`, `s3://` (and
S3-compatible servers), `gs://` — the readers the client already uses (Parquet row groups
read by range, streams for JSONL/CSV) stay the same on every store, and pyarrow's S3 and
GCS clients take credentials the way their ecosystems do (the AWS SDK's chain:
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`, `AWS_PROFILE` and
`~/.aws/config`/`credentials`, `AWS_REGION`, `AWS_ENDPOINT_URL`, instance roles; GCS's
application-default credentials). A scheme pyarrow lacks (`hf://`, Hugging Face's) goes
through fsspec when the package that registers it is installed (`huggingface_hub` for
`hf://`), wrapped as a pyarrow file system. `storage_options` (the CLI's
`--storage-option KEY=VALUE`, `--endpoint-url`) are keyword arguments of that file
system's constructor (`pyarrow.fs.S3FileSystem(endpoint_override=..., region=...)`);
they stay on the client: nothing of them goes into a job's spec.

Every failure to find or reach the input is an `InputError` naming the input and what is
wrong, raised before a job is created.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from prefixflow.shared.outcomes import Exit, PrefixflowError

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
           ".csv": "csv"}
"""Data file suffix -> format."""
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
"""Suffixes of compressed JSONL/CSV files (pyarrow's `compression="detect"`)."""
IGNORE_PREFIXES = (".", "_")
"""Names skipped below a directory or a glob's base, as `pyarrow.dataset` skips them."""
GLOB_CHARS = re.compile(r"[*?\[]")
STREAM_BUFFER = 1 << 20
"""Read-ahead of a JSONL/CSV stream (bytes)."""


class InputError(PrefixflowError, ValueError):
    """A job's input cannot be read: missing, no data files, no access, an unknown format.
    The message names the input and the reason; nothing was submitted."""

    code = Exit.USAGE


def format_of(name: str) -> str | None:
    """The data format of a file by its name (None: not a data file)."""
    lower = name.lower()
    for suffix in COMPRESSED:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            if FORMATS.get(posixpath.splitext(lower)[1]) == "parquet":
                return None  # NOTE: Parquet compresses inside; a .parquet.gz is no Parquet file
            break
    return FORMATS.get(posixpath.splitext(lower)[1])


@dataclass(frozen=True)
class Shard:
    """One data file of an input."""

    fs: pafs.FileSystem = field(repr=False, compare=False)
    path: str
    """The path in `fs`."""
    name: str
    """Its name below the input's root (its own base name for a single file): what orders
    the shards and what an input's fingerprint records."""
    size: int
    format: str

    def open_file(self) -> pafs.NativeFile:
        """A random-access file (Parquet, fingerprints)."""
        try:
            return self.fs.open_input_file(self.path)
        except OSError as exc:
            raise InputError(f"{self.path}: cannot open: {exc}") from None

    def open_stream(self) -> pafs.NativeFile:
        """A buffered stream, decompressed by its suffix (JSONL, CSV)."""
        try:
            return self.fs.open_input_stream(self.path, compression="detect", buffer_size=STREAM_BUFFER)
        except OSError as exc:
            raise InputError(f"{self.path}: cannot open: {exc}") from None


@dataclass(frozen=True)
class Source:
    """A job's input: what the user gave and its shards, in name order."""

    given: str
    shards: tuple[Shard, ...]
    single: bool
    """A file was named (not a directory or a glob)."""

    def __str__(self) -> str:
        return self.given if self.single else f"{self.given} ({len(self.shards)} files)"

    @property
    def local_file(self) -> Path | None:
        """The local file a single-file input is (None: a dataset, or a remote object)."""
        if self.single and isinstance(self.shards[0].fs, pafs.LocalFileSystem):
            return Path(self.shards[0].path)
        return None


def is_uri(text: str) -> bool:
    """`scheme://...` (a Windows drive letter is no scheme)."""
    scheme = urlsplit(text).scheme
    return len(scheme) > 1 and "://" in text


def stem_of(text: str) -> str:
    """A short name for the input (job ids): its file's stem, or its directory's or its
    glob base's name."""
    path = urlsplit(text).path if is_uri(text) else text
    base = GLOB_CHARS.split(path, 1)[0] if GLOB_CHARS.search(path) else path
    if GLOB_CHARS.search(path):
        base = base.rsplit("/", 1)[0]
    name = posixpath.basename(base.rstrip("/")) or (urlsplit(text).netloc if is_uri(text) else "") or "input"
    return name.split(".", 1)[0] or "input"


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs (`--storage-option`) as keyword arguments: `true`/`false` as
    booleans, integers as integers, anything else as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--storage-option {pair!r}: want KEY=VALUE")
        low = value.strip().lower()
        out[key.strip()] = True if low == "true" else False if low == "false" else int(low) if re.fullmatch(r"-?\d+", low) else value
    return out


S3_ALIASES = {"endpoint_url": "endpoint_override", "aws_access_key_id": "access_key",
              "aws_secret_access_key": "secret_key", "aws_session_token": "session_token", "region_name": "region"}
"""The AWS SDK's names for S3FileSystem's arguments (users know both)."""


def filesystem(text: str, options: dict[str, Any] | None = None) -> tuple[pafs.FileSystem, str]:
    """The file system of `text` (a local path or a URI) and the path in it."""
    options = dict(options or {})
    if not is_uri(text):
        if options:
            raise InputError(f"{text}: --storage-option applies to a URI (s3://, gs://, hf://), not a local path")
        return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    try:
        if scheme == "s3" and options:
            options = {S3_ALIASES.get(k, k): v for k, v in options.items()}
            return pafs.S3FileSystem(**options), parts.netloc + parts.path
        if scheme in ("gs", "gcs") and options:
            return pafs.GcsFileSystem(**options), parts.netloc + parts.path
        if scheme in ("s3", "gs", "gcs", "file") or not options:
            try:
                return pafs.FileSystem.from_uri(text)
            except ValueError as exc:  # pyarrow's ArrowInvalid
                if "nrecognized" not in str(exc):
                    raise
        return _fsspec(text, scheme, options)
    except InputError:
        raise
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(f"{text}: cannot reach its file system: {exc}") from None


def _fsspec(text: str, scheme: str, options: dict[str, Any]) -> tuple[pafs.FileSystem, str]:
    """A scheme pyarrow lacks, through fsspec (`hf://` with `huggingface_hub`)."""
    try:
        import fsspec
    except ImportError:
        raise InputError(f"{text}: pyarrow has no {scheme}:// file system and fsspec is not installed") from None
    try:
        fs, path = fsspec.core.url_to_fs(text, **options)
    except (ImportError, ValueError) as exc:
        raise InputError(f"{text}: no file system for {scheme}:// ({exc}); supported: local paths, file://, "
                         "s3://, gs://, hf:// (with huggingface_hub), and fsspec's") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "AccessDenied", "Forbidden",
          "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401")


def access_hint(exc: OSError) -> str:
    """What a refused request means to a user: the credentials (else nothing)."""
    if any(word in str(exc) for word in DENIED):
        return (" (access denied: check the credentials, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                "for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://, or --storage-option)")
    return ""


def _visible(relative: str) -> bool:
    return not any(part.startswith(IGNORE_PREFIXES) for part in relative.split("/") if part)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob (relative to its base) as a regex over `/`-separated paths: `*` and `?`
    within one name, `[...]` a set, `**` any number of folders."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def order(names: Iterable[str]) -> list[str]:
    """Data file names (relative paths) in the order their rows are numbered: visible data
    files, by name (code point order of the path, as `sorted`)."""
    return sorted(n for n in names if _visible(n) and format_of(posixpath.basename(n)) is not None)


def _listing(fs: pafs.FileSystem, base: str, recursive: bool) -> dict[str, pafs.FileInfo]:
    """Files below `base`, by their path relative to it."""
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=recursive))
    prefix = base.rstrip("/") + "/"
    return {i.path[len(prefix):] if i.path.startswith(prefix) else i.path: i for i in infos if i.type == pafs.FileType.File}


def resolve(text: str | Path, options: dict[str, Any] | None = None) -> Source:
    """The shards of an input (see the module docstring); `InputError` if it has none or
    cannot be read."""
    text = str(text)
    fs, path = filesystem(text, options)
    try:
        return _resolve(text, fs, path)
    except InputError:
        raise
    except OSError as exc:  # no such bucket, access denied, bad credentials, network
        raise InputError(f"{text}: cannot read{access_hint(exc)}: {exc}") from None


def _resolve(text: str, fs: pafs.FileSystem, path: str) -> Source:
    if GLOB_CHARS.search(path):
        return _glob(text, fs, path)
    info = fs.get_file_info(path.rstrip("/") or path)
    if info.type == pafs.FileType.File:
        fmt = format_of(info.base_name)
        if fmt is None:
            raise InputError(f"{text}: want a Parquet (.parquet), JSON lines (.jsonl) or CSV (.csv) file, or a "
                             "directory of them")
        return Source(text, (Shard(fs, info.path, info.base_name, info.size, fmt),), True)
    if info.type == pafs.FileType.Directory:
        files = _listing(fs, info.path, True)
        return _dataset(text, fs, files, "no data files (.parquet, .jsonl, .csv; names starting with '.' or '_' "
                                         "are skipped)")
    _missing(text, fs, path)
    raise AssertionError("unreachable")


def _glob(text: str, fs: pafs.FileSystem, path: str) -> Source:
    head = GLOB_CHARS.split(path, 1)[0]
    base = head.rsplit("/", 1)[0] if "/" in head else ""
    pattern = path[len(base) + 1 :] if base else path
    info = fs.get_file_info(base or ".")
    if info.type != pafs.FileType.Directory:
        _missing(text, fs, base)
    deep = "/" in pattern or "**" in pattern
    regex = glob_regex(pattern)
    files = {name: i for name, i in _listing(fs, info.path, deep).items() if regex.match(name)}
    return _dataset(text, fs, files, "no data file matches (.parquet, .jsonl, .csv; names starting with '.' or '_' "
                                     "are skipped)")


def _dataset(text: str, fs: pafs.FileSystem, files: dict[str, pafs.FileInfo], none: str) -> Source:
    names = order(files)
    if not names:
        raise InputError(f"{text}: {none}")
    shards = tuple(Shard(fs, files[n].path, n, files[n].size, format_of(n) or "") for n in names)
    return Source(text, shards, False)


def _missing(text: str, fs: pafs.FileSystem, path: str) -> None:
    """Raise the `InputError` of a path that is not there: for an object store, whether
    its bucket is."""
    if is_uri(text) and not isinstance(fs, pafs.LocalFileSystem):
        bucket = path.strip("/").split("/", 1)[0]
        if bucket and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise InputError(f"{text}: bucket {bucket!r} does not exist (or these credentials cannot see it)")
    raise InputError(f"{text}: no such file or directory")
