"""`Submitter`: a client's connection to the cluster for its jobs -- create and seal a
job's spec, claim its output directory, publish its rows and input columns, read its
status, wait for its end (`prefixflow/client/submit.py` drives it)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from tqdm import tqdm

from prefixflow.client import columns
from prefixflow.client.progress import FleetProgress, progress_note
from prefixflow.shared.bus.jobs import follow_cancel
from prefixflow.client.window import Window
from prefixflow.shared.bus.blobs import put_blob
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.fingerprint import Fingerprint, difference
from prefixflow.shared.bus.connection import close, connect, current_options
from prefixflow.shared.bus.kv_keys import bound, wait_buckets
from prefixflow.shared.bus.provision import provision
from prefixflow.client.endings import DirTaken, JobCancelled, JobFailed, JobMismatch, PauseWatch, mismatch_text
from prefixflow.shared.bus.publish import message_limit, publish

PUBLISH_CONCURRENCY = 256
ROWS_PER_MESSAGE = 64
EMPTY_JOB_WAIT = 60.0
"""Seconds to wait for the sink to complete a job of no rows before giving up."""


class Submitter:
    def __init__(self, nats_url: str, tenant: str | None = None) -> None:
        self.nats_url = nats_url
        self.tenant = os.environ.get("PFX_TENANT", "") if tenant is None else tenant
        """Whose jobs it submits ('' none): its check of the buckets reads only its own keys."""

    async def __aenter__(self) -> Submitter:
        self.nc = await connect(self.nats_url, "prefixflow-client")
        self.js = self.nc.jetstream()
        if current_options().provision:  # a local cluster: create what is missing (or wait for the services')
            await provision(self.js)
        else:  # a fleet: a client may not ask about streams (stream info names every tenant's jobs)
            await wait_buckets(self.js, subjects.JOBS_KV, subjects.probe_key(self.tenant))
        self.jobs_kv = bound(self.js, subjects.JOBS_KV)
        self.status_kv = bound(self.js, subjects.JOB_STATUS_KV)
        self.cancelled: set[str] = set()
        """Jobs of this client (`follow_cancel`) whose spec says cancelled after a notice."""
        return self

    async def follow_cancel(self, job: str) -> None:
        """Stop publishing `job` once it is cancelled: its own notices, each confirmed by
        its spec (`prefixflow.shared.bus.jobs.follow_cancel`: no other job's, no spoof)."""
        await follow_cancel(self.nc, self.jobs_kv, job, lambda spec: self.cancelled.add(spec.job))

    async def __aexit__(self, *exc: object) -> None:
        await close(self.nc)

    async def create(self, spec: m.JobSpec) -> None:
        await self.jobs_kv.put(spec.job, m.encode_json(spec))

    async def put_columns(self, job: str, chunk: columns.Chunk) -> None:
        """Store a chunk's input columns (before its rows are published: the sink reads them)."""
        if chunk.kept:
            await put_blob(self.js, self.nc, job, columns.blob_key(chunk.src), chunk.kept)

    async def publish_rows(self, job: str, rows: list[dict[str, Any]], *, batch: int = ROWS_PER_MESSAGE) -> list:
        """Publish rows as msgpack arrays of up to `batch` rows, cut by their encoded size
        under the server's limit (`message_limit`); `batch=1` sends one map per row with
        its id in the `Pfx-Id` header."""
        subject = subjects.ingest(job)
        ids = [row["id"] for row in rows]
        coros = []
        if batch == 1:
            for row in rows:
                rid = msgspec.json.encode(row["id"]).decode()
                coros.append(publish(self.js, subject, m.msgpack_encoder.encode(row), headers={"Pfx-Id": rid, "Nats-Msg-Id": f"{job}:{rid}"}))
        else:
            # NOTE: a single row over the limit goes alone and the server refuses it
            # (`MessageTooLarge`): a prompt that large cannot be a model input anyway.
            for b in m.encode_batches(rows, list, message_limit(self.js), batch):
                msg_id = f"{job}:{rows[b.start]['id']}:{rows[b.stop - 1]['id']}:{b.stop - b.start}"
                coros.append(publish(self.js, subject, b.data, headers={"Nats-Msg-Id": msg_id}))
        for i in range(0, len(coros), PUBLISH_CONCURRENCY):
            await asyncio.gather(*coros[i : i + PUBLISH_CONCURRENCY])
        return ids

    async def spec(self, job: str) -> m.JobSpec | None:
        """The job's spec in the jobs bucket (None: never created, or expired)."""
        try:
            entry = await self.jobs_kv.get(job)
        except KeyNotFoundError:
            return None
        try:
            return m.job_spec_decoder.decode(entry.value)
        except msgspec.DecodeError:
            return None

    async def claim_dir(self, out_dir: str, job: str, *, overwrite: bool = False) -> str | None:
        """Bind `out_dir` to `job` in the jobs bucket (`subjects.dir_key`). Bound to
        another job: `DirTaken`, or with `overwrite` rebound (returns the other job)."""
        key = subjects.dir_key(out_dir, subjects.tenant_of(job))
        try:
            await self.jobs_kv.create(key, job.encode())
            return None
        except KeyWrongLastSequenceError:
            pass  # bound already: to whom?
        try:
            owner = (await self.jobs_kv.get(key)).value.decode()
        except KeyNotFoundError:  # expired or deleted meanwhile
            owner = job
        if owner != job:
            if not overwrite:
                raise DirTaken(out_dir, owner, job)
        await self.jobs_kv.put(key, job.encode())
        return owner if owner != job else None

    async def dir_job(self, out_dir: str, job: str, asked: Fingerprint, overwrite: bool) -> str:
        """The job to run into `out_dir` when no job id was given (`job` is a new one): the
        job bound to it if it was asked the same (`asked`), else `job`. One asked something
        else: `JobMismatch`, unless `overwrite`. A bound job whose fingerprint is unknown
        (from before fingerprints, or gone from the bucket): `job` (`claim_dir` decides)."""
        try:
            owner = (await self.jobs_kv.get(subjects.dir_key(out_dir, subjects.tenant_of(job)))).value.decode()
        except KeyNotFoundError:
            return job
        earlier = await self.spec(owner) if owner != job else None
        if earlier is None or earlier.fingerprint is None:
            return job
        if (diff := difference(earlier.fingerprint, asked)) is None:
            return owner
        if overwrite:
            return job
        raise JobMismatch(mismatch_text(out_dir, owner, diff))

    async def status(self, job: str) -> m.JobStatus | None:
        try:
            entry = await self.status_kv.get(job)
        except KeyNotFoundError:
            return None
        return m.job_status_decoder.decode(entry.value)

    def ended(self, spec: m.JobSpec) -> bool:
        """The job was cancelled (a notice came and its spec confirmed it) or its deadline
        passed: publish no more."""
        return spec.job in self.cancelled or bool(spec.ended_at(time.time()))

    async def make_room(self, spec: m.JobSpec, window: Window, rows: int, check: Callable[[], None] | None = None) -> bool:
        """True once `rows` more may be published for the job (`prefixflow/client/window.py`),
        following the sink's count in the job's status meanwhile; False if the job ended
        (`ended`) meanwhile. Raises `JobFailed` when the status says the job failed;
        `check()` runs each round."""
        job = spec.job
        paused = PauseWatch()
        while not window.may_send(rows, time.monotonic()):
            if self.ended(spec):
                return False
            try:
                st = await self.status(job)
            except (nats.errors.Error, TimeoutError, OSError):
                st = None  # nats-server away: no news (the window's stall clock runs)
            else:
                if st is not None and st.failed:
                    raise JobFailed(job, st.error)
                if st is not None and st.done and st.cancelled:  # the sink ended it (a notice may have come
                    self.cancelled.add(job)  # before this client listened): the status is the sink's word
                    return False
                paused.observe(job, st, time.monotonic())
                window.observe(st.rows + st.duplicates if st is not None else 0, time.monotonic())
            if window.may_send(rows, time.monotonic()):
                break
            if check is not None:
                check()
            await asyncio.sleep(0.25)
        return not self.ended(spec)

    async def wait(
        self, job: str, total: int, *, progress: bool = True, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> m.JobStatus:
        """Follow the sink's progress until `total` rows are written; raise `JobFailed`
        as soon as the status says the job failed (and `TimeoutError` when a job of no
        rows is not completed within `EMPTY_JOB_WAIT`). `check()` runs each round (raise there
        to stop waiting). `JobPaused` once the job has been paused for `PAUSED_GRACE`
        seconds. A NATS outage (nats-server restarting) is waited out."""
        # Rate and ETA are the sink's (rows per second over its last 30 s), as in `prefixflow status`;
        # prompts under way and tokens/s come from the replicas' status messages (prefixflow/client/progress.py).
        bar = tqdm(total=total, desc=f"job {job}", unit="row", disable=not progress, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        fleet = self.fleet = FleetProgress()
        self.first_progress: float | None = None
        """When the line first showed work under way (`prefixflow bench batching` reads it)."""

        async def on_status(msg) -> None:
            try:
                fleet.update(m.engine_status_decoder.decode(msg.data), time.monotonic())
            except msgspec.DecodeError:
                return

        # A tenant may not read the replicas' status (it names every tenant's jobs): its
        # progress line shows rows only.
        status_sub = None if subjects.tenant_of(job) else await self.nc.subscribe(subjects.ALL_STATUS, cb=on_status)
        st = None
        paused = PauseWatch()
        try:
            while True:
                try:
                    st = await self.status(job)
                except (nats.errors.Error, TimeoutError, OSError):
                    # NOTE: nats-server away or restarting (the client reconnects by
                    # itself); the timeout below still applies.
                    pass
                if st is not None and st.failed:
                    raise JobFailed(job, st.error)
                if st is not None and st.done and st.cancelled:
                    raise JobCancelled(job, st)
                paused.observe(job, st, time.monotonic())
                if self.first_progress is None and ((st is not None and st.rows) or fleet.held(job)):
                    self.first_progress = time.time()
                if st is not None:
                    bar.n = min(st.rows, total)
                bar.set_postfix_str(progress_note(st, fleet, job), refresh=False)
                bar.refresh()
                if st is not None and st.done and st.total == total:
                    return st
                if check is not None:
                    check()
                if total == 0 and time.monotonic() - started > EMPTY_JOB_WAIT:
                    raise TimeoutError(f"job {job} has no rows and the cluster did not complete it within "
                                       f"{EMPTY_JOB_WAIT:.0f} s (status: {st})")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job} not done after {timeout} s (status: {st})")
                await asyncio.sleep(0.5)
        finally:
            bar.close()
            try:
                if status_sub is not None:
                    await status_sub.unsubscribe()
            except nats.errors.Error:
                pass
