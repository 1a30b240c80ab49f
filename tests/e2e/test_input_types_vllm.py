"""Every input column keeps its Arrow type and values on real vLLM: the input of
tests/nats/test_input_types.py (a column of each kind users bring, a 3 MiB value) through
`prefixflow submit` to the shared two-replica vLLM cluster (it was a `run` of its own: the
join does not depend on how the cluster was started; `run` is tested there on echo
engines)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli
from tests.nats.test_input_types import check_every_column, input_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(500)]


def test_every_input_type_comes_out_as_it_went_in_on_vllm(vllm_cluster, tmp_path):
    data, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(input_table(), data, row_group_size=128)
    res = run_cli("submit", str(data), "--out", str(out), "--nats", vllm_cluster.url, "--job", "types-vllm",
                  "--no-progress", "--timeout", "400", "--max-tokens", "4", timeout=480)
    assert res.returncode == 0, res.stdout + res.stderr + vllm_cluster.tail()
    vllm_cluster.check_alive()  # no process of the Procfile exited (honcho stops them all if one does)
    check_every_column(data, out)
