"""Job outputs in object storage (`--out s3://bucket/prefix/`, `gs://...`): the file system,
and which files of an output are committed. Read by the sink (which writes them:
`prefixflow/services/sink/objstore.py`), the client and `report` (which read them).

An object store has no rename, so a job's output there is committed by a manifest,
`_manifest.json` beside the data: {"files": ["part-000000-000099.parquet", ...]}. A data
object exists whole or not at all (each is one PUT), and it is part of the job's output
once the manifest names it. Readers go by the manifest; after the job is done only the
files it names are under the prefix, so a plain `pyarrow.dataset.dataset("s3://.../")`
sees every row once.

Credentials and endpoints are the sink's own (never in a job's spec): pyarrow's S3 client
takes the AWS SDK's chain (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`,
`AWS_PROFILE`, config files, instance roles), `AWS_REGION`, and the endpoint of an
S3-compatible server from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (read here: the
S3FileSystem constructor does not). GCS takes its application-default credentials.
"""

from __future__ import annotations

import json
import os
import posixpath
from urllib.parse import urlsplit

import pyarrow.fs as pafs

FILES_MANIFEST = "_manifest.json"
"""The committed data files of a job's output in an object store."""
SCHEMES = ("s3", "gs", "gcs")
"""URI schemes an output may have (besides a local path)."""


class OutputLocationError(ValueError):
    """An output URI that cannot be used (a scheme we do not write, no bucket, `..`)."""


def is_output_uri(text: str) -> bool:
    """`text` names an object store location (`s3://`, `gs://`), not a local directory."""
    return urlsplit(text).scheme.lower() in SCHEMES and "://" in text


def normalize(uri: str) -> tuple[str, str, str]:
    """(scheme, bucket, key prefix without slashes at either end) of an output URI;
    `OutputLocationError` for one with `.`/`..` or empty segments, or no bucket."""
    parts = urlsplit(uri)
    scheme = "gs" if parts.scheme.lower() == "gcs" else parts.scheme.lower()
    if scheme not in ("s3", "gs") or not parts.netloc:
        raise OutputLocationError(f"{uri!r}: want s3://bucket/prefix/ or gs://bucket/prefix/")
    if parts.query or parts.fragment or "\x00" in uri:
        raise OutputLocationError(f"{uri!r}: no query, fragment or NUL in an output URI")
    segments = [s for s in parts.path.split("/")]
    inner = segments[1:-1] if len(segments) > 2 else []
    if any(s in (".", "..") for s in segments) or any(s == "" for s in inner):
        raise OutputLocationError(f"{uri!r}: no '.', '..' or empty segments in an output URI")
    return scheme, parts.netloc, parts.path.strip("/")


def canonical(uri: str) -> str:
    """The one spelling of an output URI: `s3://bucket/prefix` (no trailing slash)."""
    scheme, bucket, key = normalize(uri)
    return f"{scheme}://{bucket}/{key}" if key else f"{scheme}://{bucket}"


def object_prefix(text: str) -> str:
    """`text` as an object store prefix (canonical); `OutputLocationError` for anything
    else (a local path, a bad URI)."""
    if not is_output_uri(text):
        raise OutputLocationError(f"{text!r}: want s3://bucket/prefix or gs://bucket/prefix")
    return canonical(text)


def within(uri: str, root: str) -> bool:
    """`uri` is the output root `root` or below it (whole segments: `s3://b/out` is not
    under `s3://b/o`)."""
    a, b = canonical(uri), canonical(root)
    return a == b or a.startswith(b + "/")


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The file system of an output URI and the base path in it (`bucket/prefix`).
    S3 objects under pyarrow's part size (10 MiB) are written in one PUT
    (`allow_delayed_open`)."""
    scheme, bucket, key = normalize(uri)
    base = posixpath.join(bucket, key) if key else bucket
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        return pafs.S3FileSystem(endpoint_override=endpoint, region=region, allow_delayed_open=True), base
    return pafs.GcsFileSystem(), base  # an emulator: CLOUD_STORAGE_EMULATOR_ENDPOINT (tests/nats/test_gcs.py)


REFUSED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "AccessDenied", "Forbidden")
"""Words of pyarrow's S3/GCS errors that mean the credentials were refused."""


def hint(exc: BaseException) -> str:
    """What an object store's error means for whoever reads a job's status ("" if nothing
    more to say): credentials refused, or no such bucket."""
    text = str(exc)
    if any(word in text for word in REFUSED):
        return (" (the object store refused the sink's credentials: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://, in the sink's environment)")
    if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text:
        return " (the bucket does not exist: create it, or choose another --out)"
    return ""


def read_json(fs: pafs.FileSystem, path: str) -> dict | None:
    """A small JSON object of a store (None: there is none)."""
    try:
        with fs.open_input_stream(path) as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    return doc if isinstance(doc, dict) else None


def committed_files(uri: str) -> list[str]:
    """The committed data files of the job output at `uri`, as `bucket/prefix/name`
    paths in its file system, in part order (the manifest's)."""
    fs, base = filesystem(uri)
    doc = read_json(fs, f"{base}/{FILES_MANIFEST}") or {}
    return [f"{base}/{name}" for name in doc.get("files", []) if isinstance(name, str)]
