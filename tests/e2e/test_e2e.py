"""End to end: `honcho start` on the Procfile (nats-server + five services, two real vLLM
replicas), jobs submitted with `prefixflow submit` or by publishing to the ingest subject."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.datagen.dataset import ideal_hit_rate, write_prefix_repetition
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import reset_prefix_caches, run_cli, set_policy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def read_output(out_dir) -> list[dict]:
    return pq.read_table(out_dir).to_pylist()


def test_prefix_job_via_submit_cli(vllm_cluster, tiny_model, tmp_path):
    data = tmp_path / "prompts.parquet"
    made = run_cli(
        "dataset", "prefix-repetition", "--num-prompts", "240", "--prefix-len", "256", "--suffix-len", "64",
        "--num-prefixes", "8", "--output-len", "8", "--seed", "1", "--model", str(tiny_model), "--out", str(data),
    )
    assert made.returncode == 0, made.stderr
    out = tmp_path / "out"
    res = run_cli(
        "submit", str(data), "--out", str(out), "--nats", vllm_cluster.url, "--job", "e2e-main",
        "--max-tokens", "8", "--min-tokens", "8", "--no-progress", "--timeout", "600",
    )
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{vllm_cluster.tail()}"

    rows = read_output(out)
    inputs = {r["id"]: r for r in pq.read_table(data).to_pylist()}
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(inputs), "every id exactly once"
    assert len(ids) == len(set(ids)) == 240
    assert all(r["error"] is None for r in rows)
    # A random-weight model may pick EOS first (an empty output, seen in CI): --min-tokens holds it off.
    assert all(r["output"] and r["output_tokens"] == 8 for r in rows)
    # Input columns are carried through untouched.
    assert all(r["prompt"] == inputs[r["id"]]["prompt"] and r["prefix_id"] == inputs[r["id"]]["prefix_id"] for r in rows)
    assert sum(r["cached_tokens"] for r in rows) > 0, "prefix caching never hit"
    assert {r["replica"] for r in rows} == {"r0", "r1"}, "both replicas used"

    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == 240 and summary["errors"] == 0
    assert summary["prefix_cache_hit_rate"] == pytest.approx(
        sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows), abs=1e-3
    )
    assert summary["prefix_cache_hit_rate"] > 0
    assert set(summary["replicas"]) == {"r0", "r1"}
    assert sum(s["rows"] for s in summary["replicas"].values()) == 240


async def _bad_input_job(url: str, good: list[dict], out_dir: str, long_prompt: str) -> tuple[m.JobStatus, list]:
    job = "e2e-bad-input"
    async with Submitter(url) as client:
        await client.create(m.JobSpec(job=job, out_dir=out_dir, sampling=m.SamplingSpec(max_tokens=4)))
        half = len(good) // 2
        await client.publish_rows(job, good[:half])
        # Mid-job: malformed input straight into the ingest subject, as a buggy publisher would.
        ingest = subjects.ingest(job)
        js = client.js
        await js.publish(ingest, b'{"id": 1001, "prompt": "unterminated', headers={"Pfx-Id": "1001"})
        await js.publish(ingest, b'{"id": 1002, "prompt": "bad \xff\xfe bytes"}', headers={"Pfx-Id": "1002"})
        await js.publish(ingest, msgspec.json.encode({"id": 1003, "prompt": "   "}))
        await js.publish(ingest, msgspec.json.encode({"id": 1004, "prompt": long_prompt}))
        await js.publish(ingest, msgspec.msgpack.encode({"id": 1005}))  # no prompt
        await js.publish(ingest, b"\x00garbage with no id at all")  # no id: dead-lettered
        await js.publish(subjects.ingest("no-such-job"), msgspec.json.encode({"id": 1, "prompt": "hi"}))
        await client.publish_rows(job, good[half:])
        await client.create(m.JobSpec(job=job, out_dir=out_dir, sampling=m.SamplingSpec(max_tokens=4), total=len(good) + 5))
        status = await client.wait(job, len(good) + 5, progress=False, timeout=600)

        dead = []
        sub = await js.subscribe("pfx.dead.>", ordered_consumer=True)
        try:
            while True:
                msg = await sub.next_msg(timeout=2)
                dead.append((msg.subject, (msg.headers or {}).get("Pfx-Error", "")))
        except Exception:  # noqa: BLE001 - timeout: no more dead letters
            pass
        await sub.unsubscribe()
    return status, dead


def test_bad_input_mid_job_becomes_error_rows(vllm_cluster, tiny_model, tmp_path):
    data = tmp_path / "good.parquet"
    table = write_prefix_repetition(
        data, tokenizer_dir=tiny_model, num_prompts=40, prefix_len=128, suffix_len=32, num_prefixes=4, output_len=4, seed=2
    )
    good = [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]
    long_prompt = " ".join([good[0]["prompt"]] * 40)  # ~6400 tokens > max_model_len 4096
    out = tmp_path / "out"
    status, dead = asyncio.run(_bad_input_job(vllm_cluster.url, good, str(out), long_prompt))
    assert status.done and status.rows == len(good) + 5 and status.errors == 5

    rows = {r["id"]: r for r in read_output(out)}
    assert len(rows) == len(good) + 5
    assert "malformed" in rows[1001]["error"]
    assert "UTF-8" in rows[1002]["error"]
    assert rows[1003]["error"] == "empty prompt"
    assert "too long" in rows[1004]["error"]
    assert "prompt" in rows[1005]["error"]
    for g in good:
        r = rows[g["id"]]
        assert r["error"] is None and r["output"], r
    errors = [e for _, e in dead]
    assert any("malformed" in e for e in errors), dead
    assert any("unknown job" in e for e in errors), dead


def test_prefix_aware_routing_reaches_ideal_hit_rate(vllm_cluster, tiny_model, tmp_path):
    """Four jobs over the same 32 prefixes, one after another (a user's habit: the same
    system prompts, job after job), through `prefixflow submit`; same engines, KV cache
    constrained (the prefixes and the running prompts do not fit in one replica's cache);
    caches cold before each policy's first job and warm from job to job.

    Every prefix group comes back in every job, so its place is decided four times (more
    when a job's group leaves the bucketer in pieces): prefix-aware sends it back to the
    replica that holds it; round-robin sends it wherever its turn falls, so about half the
    groups are computed again on the other replica in each later job, and each replica
    must keep most of the 32 prefixes (96 blocks) next to its running requests in 128
    blocks, so some are evicted and computed again. Each such miss costs 384 of 253,952
    prompt tokens (0.0015 of hit rate). The structure of the workload makes the
    difference, not the timing of the shared machine (one job of all 512 prompts left
    the difference to how the bucketer's buffer happened to cut the groups: round-robin
    came within noise of prefix-aware once the hot path got faster). Asserted:
    prefix-aware reaches >= 90 % of the ideal hit rate over the four jobs and leads
    round-robin by >= 2 points (docs/benchmarks.md has the measured figures)."""
    data = tmp_path / "prompts.parquet"
    # 3 prefix blocks + 1 block of suffix and output per prompt (384 + 112 + 8 tokens), shuffled.
    table = write_prefix_repetition(
        data, tokenizer_dir=tiny_model, num_prompts=512, prefix_len=384, suffix_len=112, num_prefixes=32, output_len=8, seed=3
    )
    ideal = ideal_hit_rate(table, block_size=128)  # each prefix computed once over the four jobs
    assert 32 * 3 + 512 * 1 > 2 * 128, "the dataset's KV (shared prefixes + 1 block a prompt) must not fit in the caches"
    jobs = []
    for j in range(4):  # consecutive slices of the shuffled table: each group in every job, in uneven numbers
        jobs.append(tmp_path / f"job{j}.parquet")
        pq.write_table(table.slice(128 * j, 128), jobs[-1])
    assert all(len(set(pq.read_table(f, columns=["prefix_id"]).column(0).to_pylist())) >= 24 for f in jobs)
    rates: dict[str, list[float]] = {"round-robin": [], "prefix-aware": []}
    for policy in rates:
        asyncio.run(set_policy(vllm_cluster.url, policy))
        asyncio.run(reset_prefix_caches(vllm_cluster.url, ["r0", "r1"]))
        for j, path in enumerate(jobs):
            out = tmp_path / f"{policy}-{j}"
            res = run_cli(
                "submit", str(path), "--out", str(out), "--nats", vllm_cluster.url, "--job", f"e2e-{policy}-{j}",
                "--max-tokens", "8", "--no-progress", "--timeout", "600",
            )
            assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{vllm_cluster.tail()}"
            summary = json.loads((out / "_summary.json").read_text())
            assert summary["rows"] == 128 and summary["errors"] == 0
            rates[policy].append(summary["prefix_cache_hit_rate"])
    # Every prompt has the same length: the mean of the jobs' rates is the rate over all four.
    mean = {policy: sum(r) / len(r) for policy, r in rates.items()}
    print(f"\nideal {ideal:.4f}  " + "  ".join(f"{k} {mean[k]:.4f} {v}" for k, v in rates.items()))
    assert mean["prefix-aware"] >= 0.9 * ideal, (mean, ideal)
    assert mean["prefix-aware"] - mean["round-robin"] >= 0.02, rates


def test_vllm_replica_killed_at_a_third_fails_over(tmp_path, tiny_model, clusters):
    """Two real vLLM replicas (the engine-kill tests' shared cluster: killing an engine
    under honcho would stop honcho); r0 is SIGKILLed at about a third of the job and not
    restarted: r1 finishes the job; then r0 is started again while a second job runs on r1
    alone, and gets work of it. It ends with both replicas running."""
    from prefixflow.services.engine_worker.guard import descendants, proc_stat
    from tests.conftest import special_vllm_cluster, wait_replicas_ready

    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=300, prefix_len=128, suffix_len=64, num_prefixes=6, output_len=16, seed=11)
    cluster = special_vllm_cluster(clusters, tiny_model)
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in pq.read_table(data).to_pylist()]

    async def go() -> tuple[m.JobStatus, float]:
        out = str(tmp_path / "out")
        async with Submitter(cluster.url) as client:
            sampling = m.SamplingSpec(max_tokens=16, min_tokens=16, ignore_eos=True)
            await client.create(m.JobSpec(job="failover", out_dir=out, sampling=sampling, total=len(rows)))
            await client.publish_rows("failover", rows)
            while ((await client.status("failover")) or m.JobStatus("failover")).rows < len(rows) // 3:
                await asyncio.sleep(0.05)
            children = descendants(cluster.running["engine0"].pid)
            assert children, "the vLLM engine core runs in child processes"
            killed_at = time.monotonic()
            cluster.running["engine0"].kill()
            status = await client.wait("failover", len(rows), progress=False, timeout=600)
            # The guard SIGKILLs the engine core of a SIGKILLed worker: no orphans.
            while any(proc_stat(pid) is not None and proc_stat(pid)[1] == t for pid, t in children.items()):
                assert time.monotonic() - killed_at < 30, "vLLM engine core orphaned by a killed worker"
                await asyncio.sleep(0.2)
            return status, time.monotonic() - killed_at

    status, after_kill = asyncio.run(go())
    print(f"\nvllm failover: job finished {after_kill:.1f} s after r0 was killed")
    assert status.done and status.rows == 300 and status.errors == 0
    out_rows = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted(r["id"] for r in out_rows) == sorted(r["id"] for r in rows)
    assert cluster.running["engine0"].poll() is not None, "r0 stayed dead"
    assert {r["replica"] for r in out_rows} == {"r0", "r1"}, "r0 did part of the job before it died"

    # Restarted while a second job runs on r1 alone: r0 comes back under its name and gets
    # work of that job. (One engine start: this was a second SIGKILL and restart at once,
    # an engine start more for what the first kill already holds: a SIGKILLed replica's
    # in-flight prompts go to the live one; merged here.)
    engine0 = next(p for p in cluster.procs if p.name == "engine0")

    async def restart_mid_job() -> tuple[m.JobStatus, float]:
        out = str(tmp_path / "out2")
        sampling = m.SamplingSpec(max_tokens=16, min_tokens=16, ignore_eos=True)
        rows2 = [{"id": r["id"], "prompt": r["prompt"]} for r in rows]
        async with Submitter(cluster.url) as client:
            await client.create(m.JobSpec(job="restart", out_dir=out, sampling=sampling, total=len(rows2)))
            await client.publish_rows("restart", rows2[: len(rows2) // 2])
            while ((await client.status("restart")) or m.JobStatus("restart")).rows < len(rows2) // 6:
                await asyncio.sleep(0.05)
            t_start = time.monotonic()
            cluster.start_one(engine0)
            await wait_replicas_ready(cluster.url, ["r0"], 300, cluster.check_alive)
            back = time.monotonic() - t_start
            await client.publish_rows("restart", rows2[len(rows2) // 2 :])
            status = await client.wait("restart", len(rows2), progress=False, timeout=600)
            return status, back

    status, back = asyncio.run(restart_mid_job())
    print(f"vllm restart mid-job: r0 ready again {back:.1f} s after it was started")
    assert status.done and status.rows == 300 and status.errors == 0
    out2 = pq.read_table(tmp_path / "out2").to_pylist()
    assert sorted(r["id"] for r in out2) == sorted(r["id"] for r in rows)
    second_half = {r["id"] for r in rows[len(rows) // 2 :]}
    assert any(r["replica"] == "r0" for r in out2 if r["id"] in second_half), "r0 rejoined and got new work"
