"""The report `run` and `submit` write when a job ends: `OUT/_report/index.html` and its
plots, beside the output. For an output in an object store (`--out s3://bucket/prefix/`)
the report is made in a local temporary directory and uploaded under `PREFIX/_report/`
with this process's credentials (a reader of the prefix's data skips `_` folders; the
sink deletes `_report/` when the job is run again)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefixflow.report.job_report import write_report
from prefixflow.report.rows import SAMPLE_ROWS
from prefixflow.shared.outputs import filesystem, is_output_uri

REPORT_DIR = "_report"


def upload_report(local: Path, uri: str) -> str:
    """Copy the report's files in `local` to `uri/_report/`; the index's URI."""
    fs, base = filesystem(uri)
    for path in sorted(local.iterdir()):
        if path.is_file():
            with fs.open_output_stream(f"{base}/{REPORT_DIR}/{path.name}") as f:
                f.write(path.read_bytes())
    return f"{uri.rstrip('/')}/{REPORT_DIR}/index.html"


def auto_report(out_dir: str | Path, rows: int, model: str | None = None) -> None:
    """The report of the job just done in `out_dir`, from at most `SAMPLE_ROWS` rows
    (seconds and bounded memory at any job size). A report that cannot be written is a
    note, never a failed job."""
    remote = is_output_uri(str(out_dir))
    if not remote and not (Path(out_dir) / "_summary.json").exists():
        return  # the output is on another machine (the sink's)
    if rows == 0:
        return  # nothing to plot
    try:
        if remote:
            with tempfile.TemporaryDirectory(prefix="pfx-report-") as tmp:
                index = upload_report(write_report(out_dir, tmp, model=model).parent, str(out_dir))
        else:
            index = str(write_report(out_dir, model=model))
    except Exception as exc:  # noqa: BLE001 - the job's rows are written; only the plots failed
        print(f"note: no report ({exc!r}); try `prefixflow report {out_dir}`", flush=True)
        return
    more = f" (from a sample of {SAMPLE_ROWS:,} of {rows:,} rows)" if rows > SAMPLE_ROWS else ""
    print(f"report: {index}{more}", flush=True)
