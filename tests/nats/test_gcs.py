"""`gs://` inputs and outputs (issue 41) against a GCS emulator (`tests/gcs_server.py`:
gcp-storage-emulator from PyPI), through `prefixflow run` with the credentials and
endpoint in its environment only: 4 shards in a bucket -> an output prefix in the same
bucket, every id once, input columns byte-exact, only committed objects there; the same
command again: "already done", nothing started."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.gcs_server import GcsServer
from tests.nats.test_inputs import settle, shard_tables
from tests.nats.test_s3_outputs import FINAL, run_s3

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    server = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    yield server
    server.stop()


def test_gs_shards_to_a_gs_out_through_run_then_again(gcs, tmp_path):
    fs = gcs.filesystem()
    tables = shard_tables()
    for i, table in enumerate(tables):
        pq.write_table(table, f"{gcs.bucket}/in/part-{i:02d}.parquet", filesystem=fs)
    out = gcs.uri("out/run/")
    (code, text), = settle({"run": run_s3(gcs.uri("in/"), out, gcs.env, tmp_path)}).values()
    assert code == 0, text

    names = {i.path.split("/out/run/", 1)[1] for i in fs.get_file_info(pafs.FileSelector(f"{gcs.bucket}/out/run",
                                                                                          recursive=True))
             if i.type == pafs.FileType.File}
    manifest = json.loads(fs.open_input_stream(f"{gcs.bucket}/out/run/_manifest.json").read())
    assert {n for n in names if not n.startswith("_report/")} == FINAL | set(manifest["files"]), names
    assert "_report/index.html" in names, names  # run's report, uploaded beside the data

    got = ds.dataset(f"{gcs.bucket}/out/run", filesystem=fs, format="parquet").to_table()
    got = got.take(pc.sort_indices(got, [("id", "ascending")]))
    want = pa.concat_tables(tables)
    assert got.column("id").to_pylist() == list(range(want.num_rows)), "every id once"
    for name in want.column_names:
        assert got.column(name).equals(want.column(name)), name

    (code, text), = settle({"again": run_s3(gcs.uri("in/"), out, gcs.env, tmp_path)}).values()
    assert code == 0 and "already done" in text and "starting local cluster" not in text, text
