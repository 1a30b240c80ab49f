"""A one-node fleet as `prefixflow cluster config` writes it (NATS users and grants, TLS
with its own CA: both on), running a job and the batch API under those credentials
(issue 40: the API could not start under its grant, a one-node config did not load).

One start for every assert: the node's nats-server from its unit (whose ExecStartPre,
`nats-server -t`, checks the generated config), streams provisioned by admin, then the
node's units (bucketer, an echo engine, ingestor, router, sink, api) with their env files
(`tests/fleet.py`), each node its own network namespace when the test runs as root.

- `prefixflow submit` as tenant alice runs a job, every id once;
- the API starts, lists (no consumer: its grant allows none), takes a file and a batch
  from alice, and the batch completes with its output file; bob sees none of it;
- alice's API key holds `#`, `,`, `:`, spaces, quotes and a backslash (set in
  `secrets.json`): the keys file `cluster config` writes carries it to the API, her
  `clients/tenant-alice.env` to her shell, and the API takes exactly it;
- the server logged no permission violation and no service hit one.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.launch.local_cluster import free_port
from tests.conftest import VENV_BIN
from tests.fleet import Fleet, wait_ready

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

ALICE_KEY = 'ab#01,23 "q" \'s\' \\x:y'
"""Printable ASCII a keys file must carry whole (the env var would split it at `,`)."""
N = 200
REQUESTS = 30


def shell_value(env_files: list, name: str) -> str:
    """`name` as a user's shell has it after `set -a; . FILE; ...` (README)."""
    script = "set -a; " + " ".join(f'. "{f}";' for f in env_files) + f' printf %s "${name}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=10).stdout


def start_node(tmp_path, tiny_model) -> tuple[Fleet, int]:
    fleet = Fleet(tmp_path / "fleet", 1, model=tiny_model, tenants=("alice", "bob"))
    fleet.etc_root.mkdir(parents=True)
    (fleet.etc_root / "secrets.json").write_text(json.dumps({"api_keys": {"alice": ALICE_KEY}}))
    fleet.start()
    port = free_port()
    try:
        fleet.service("prefixflow-bucketer.service", 0)
        fleet.service("prefixflow-engine@.service", 0, instance="0", env={"PFX_ENGINE": "echo"})
        for unit in ("ingestor", "router", "sink"):
            fleet.service(f"prefixflow-{unit}.service", 0)
        fleet.api(0, port)
        asyncio.run(wait_ready(fleet.url(0), fleet.options("admin"), ["nats-1-gpu0"], 90, fleet.check_alive))
    except BaseException:
        fleet.stop()
        raise
    return fleet, port


def completion_line(i: int, model: str) -> str:
    # NOTE: completions, not chat: rendering a chat template imports vLLM in the ingestor
    # (tens of seconds on a busy machine), which the other batch API tests cover.
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": model, "prompt": f"say {i}", "max_tokens": 4}})


def run_batch(client: openai.OpenAI, path, model: str):
    path.write_text("".join(completion_line(i, model) + "\n" for i in range(REQUESTS)))
    f = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 90
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    return f, batch


def test_a_one_node_fleet_runs_a_job_and_the_batch_api_under_its_own_grants(tmp_path, tiny_model):
    fleet, port = start_node(tmp_path, tiny_model)
    try:
        assert fleet.url(0).startswith("tls://") and fleet.options("api").nats_user == "api"
        keys_file = fleet.etc(0) / "api-keys"
        assert keys_file.stat().st_mode & 0o777 == 0o600 and f"alice {ALICE_KEY}\n" in keys_file.read_text()
        clients = fleet.etc_root / "clients"
        assert shell_value([clients / "env", clients / "tenant-alice.env"], "OPENAI_API_KEY") == ALICE_KEY
        bob_key = shell_value([clients / "tenant-bob.env"], "OPENAI_API_KEY")
        assert bob_key and bob_key != ALICE_KEY

        # A job through the node, as tenant alice.
        data = tmp_path / "prompts.parquet"
        pq.write_table(pa.table({"id": list(range(N)), "prompt": [f"prompt {i % 9} {i}" for i in range(N)]}), data)
        out = fleet.out_root / "alice" / "job"
        res = subprocess.run([str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--job", "job",
                              "--max-tokens", "4", "--no-progress", "--timeout", "90"],
                             capture_output=True, text=True, timeout=120, env=fleet.cli_env(0, "tenant-alice"))
        assert res.returncode == 0 and f"job alice.job: {N} rows (0 errors)" in res.stdout, res.stdout + res.stderr
        assert sorted(pq.read_table(out).column("id").to_pylist()) == list(range(N))

        # The batch API, with the keys cluster config wrote.
        base = fleet.api_url(0, port)
        alice = openai.OpenAI(api_key=ALICE_KEY, base_url=base, max_retries=0)
        bob = openai.OpenAI(api_key=bob_key, base_url=base, max_retries=0)
        for partial in ("ab", "ab#01", 'ab#01,23 "q"'):  # what a parser cutting at `#`, `,` or a space would keep
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(api_key=partial, base_url=base, max_retries=0).files.list()
        assert list(alice.batches.list()) == [] and list(bob.files.list()) == []
        f, batch = run_batch(alice, tmp_path / "batch.jsonl", tiny_model.name)
        assert batch.status == "completed" and batch.request_counts.completed == REQUESTS, batch
        lines = [json.loads(x) for x in alice.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(REQUESTS))
        assert all(x["response"]["status_code"] == 200 for x in lines)
        assert [b.id for b in alice.batches.list()] == [batch.id]
        assert {x.id for x in alice.files.list()} == {f.id, batch.output_file_id}
        assert list(bob.batches.list()) == [] and list(bob.files.list()) == []
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)

        # The grants were enough for every process: the server logged no violation.
        violations = [x for x in fleet.procs["nats-1"].log.read_text(errors="replace").splitlines() if "Violation" in x]
        assert violations == [], violations[:5]
        for name, proc in fleet.procs.items():
            assert "permission denied" not in proc.log.read_text(errors="replace"), (name, fleet.tail(name))
        assert fleet.restarts() == {}, "no process exited"
    finally:
        fleet.stop()
