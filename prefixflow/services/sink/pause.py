"""Paused jobs: a job whose output lacks a resource waits, its results kept, never poison.

A full disk, a quota, a read-only file system or a missing permission at a job's output
(`boundary.RESOURCE_ERRNOS`) is not the job's fault and not its results' fault. The job
**pauses** (issue 39, item 3):

1. its status says `paused` with the reason and the directory (`JobStatus.paused`,
   `paused_path`): `run`/`submit` exit with code 75 (EX_TEMPFAIL) naming it;
2. its results in hand, and every result of it that arrives while it is paused, are
   **parked**: copied to `subjects.parked(job)` (the `PFX_PARKED` stream) and acked. They
   stay in JetStream, out of the sink's consumer: a paused job holds none of its
   `max_ack_pending` slots, so jobs whose output is elsewhere go on at full speed. The
   copy carries the failed deliveries that were the message's own (`PRIOR_DELIVERIES`;
   the resource fault is not one), so the poison limit never counts a pause;
3. every `RECHECK` seconds the job's directory is probed (`probe`: enough room free,
   and a small file written, synced and removed); once it passes the job resumes: its
   status is cleared and its parked results move back to `subjects.results(origin, job)`, in
   the background (`unpark`), written as they come. A job that fails again pauses again.
   Enough room is `PROBE_BYTES` more than twice what was free when the write failed (that
   write needed more than that): a disk that frees a little does not resume a job only
   for it to pause again at its next part (with room for it, a part that is larger still
   pauses it once more, and the next bar is twice as high).

If parking itself fails (JetStream's store is full too) the message is nak'd with a
delay instead, and that delivery is excused in memory (`Excused`): not counted either.
After a sink restart, jobs with parked results are found from the stream (`parked_jobs`)
and resumed (or paused again by their next write).
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from prefixflow.shared.bus.poison import POISON_AFTER, PRIOR_DELIVERIES, deliveries
from prefixflow.shared.bus.provision import job_retention
from prefixflow.shared.bus.publish import publish
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.process.tasks import stop_tasks

ORIGIN_HEADER = "Pfx-Origin"
"""A parked message's origin (`subjects.results`): its results go back under it."""

log = structlog.get_logger()

RECHECK = 2.0
"""Seconds between probes of a paused job's directory."""
PROBE_BYTES = 1024 * 1024
"""Free bytes a paused job's file system needs before the job resumes, beyond twice what
was free when it paused."""
PARK_ATTEMPTS = 3
"""Publish attempts to park one message before it is nak'd instead (the store is full)."""
NAK_DELAY = 5.0
"""Seconds before a message that could not be parked is delivered again."""
MAX_PAUSED = 10_000
"""Paused jobs remembered (the oldest forgotten first: their next write pauses them again)."""
MAX_EXCUSED = 100_000
"""Messages whose excused deliveries are remembered (the oldest forgotten first)."""

WHAT = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
"""What each resource fault means, as the job's status says it."""


def reason(exc: BaseException, path: Path) -> str:
    """The paused job's status text: what is missing, where, and how much room there is,
    e.g. `no space left on the device at /data/out (file system /data: 12.0 KiB free of
    4.0 MiB): [Errno 28] No space left on device`."""
    what = WHAT.get(getattr(exc, "errno", None), "the output lacks a resource")
    return f"{what} at {path}{room(path)}: {exc}"


def room(path: Path) -> str:
    """` (file system M: F free of T)` for the file system holding `path` ('' if unknown)."""
    try:
        where = existing(path)
        st = os.statvfs(where)
    except OSError:
        return ""
    mount = where
    while not os.path.ismount(mount) and mount.parent != mount:
        mount = mount.parent
    return f" (file system {mount}: {size(st.f_bavail * st.f_frsize)} free of {size(st.f_blocks * st.f_frsize)})"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a job's directory may not, yet)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes free for writing on the file system of `path` (0 if it cannot be told)."""
    try:
        st = os.statvfs(existing(path))
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def probe(path: Path, needed: int = PROBE_BYTES) -> None:
    """Raise the OSError a write at `path` would get now; return if it would succeed:
    `needed` bytes free, and a small file created, written, synced and removed there (or in
    its nearest existing ancestor, which the job's directory is created in)."""
    where = existing(path)
    st = os.statvfs(where)
    if st.f_bavail * st.f_frsize < needed:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (under {size(needed)} free)", str(where))
    probe_file = where / f".pfx-probe-{os.getpid()}"
    try:
        with open(probe_file, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            probe_file.unlink()
        except FileNotFoundError:
            pass


class Excused:
    """Deliveries of messages that were not their own fault (a nak while their job could
    not be parked), by stream sequence, in this process."""

    def __init__(self) -> None:
        self.counts: OrderedDict[int, int] = OrderedDict()

    def add(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        self.counts[seq] = self.counts.pop(seq, 0) + 1
        while len(self.counts) > MAX_EXCUSED:
            self.counts.popitem(last=False)

    def own(self, msg: Msg) -> int:
        """The deliveries of `msg` that count toward poison."""
        return deliveries(msg) - self.counts.get(msg.metadata.sequence.stream, 0)

    def is_poison(self, msg: Msg) -> bool:
        return self.own(msg) > POISON_AFTER


@dataclass
class Pause:
    reason: str
    path: Path
    since: float
    """Unix time it paused."""
    checked: float
    """Monotonic time of the last probe (or of the pause)."""
    needed: int = PROBE_BYTES
    """Free bytes its file system needs before it resumes."""


class Pauses:
    """The sink's paused jobs: pause, park, probe, resume (see the module's doc)."""

    def __init__(self, where: Callable[[str], Awaitable[Path]]) -> None:
        self.js: JetStreamContext | None = None
        self.status_kv = None
        """The connection's JetStream context and status bucket (`connect`)."""
        self.where = where
        """The job's output directory (the path a pause names and probes)."""
        self.paused: OrderedDict[str, Pause] = OrderedDict()
        self.excused = Excused()
        self.moving: dict[str, asyncio.Task] = {}
        """Jobs whose parked results are being moved back."""
        self.parked_seen = 0.0
        """Monotonic time parked jobs were last looked for (after a restart, and then rarely)."""

    def connect(self, js: JetStreamContext, status_kv) -> None:
        self.js, self.status_kv = js, status_kv

    def __contains__(self, job: str) -> bool:
        return job in self.paused

    async def pause(self, job: str, exc: OSError, msgs: list[Msg]) -> None:
        """`job`'s output lacks a resource (`exc`): pause it (status) and park `msgs`."""
        if job not in self.paused:
            path = await self.where(job)
            why = reason(exc, path)
            free = await asyncio.to_thread(free_bytes, path)
            self.paused[job] = Pause(why, path, time.time(), time.monotonic(), 2 * free + PROBE_BYTES)
            while len(self.paused) > MAX_PAUSED:
                self.paused.popitem(last=False)
            log.error("job paused: its output lacks a resource; its results are parked until it resumes", job=job,
                      path=str(path), reason=why)
            await self.put_status(job)
        await self.park(job, msgs)

    async def park(self, job: str, msgs: list[Msg]) -> None:
        """Move `msgs` (results of paused `job`) to its parked subject, acked; a message
        that cannot be parked is nak'd with a delay, that delivery excused."""
        await asyncio.gather(*(self._park_one(job, msg) for msg in msgs))

    async def _park_one(self, job: str, msg: Msg) -> None:
        headers = {k: v for k, v in (msg.headers or {}).items() if k not in ("Nats-Msg-Id", PRIOR_DELIVERIES)}
        meta = msg.metadata
        # The failed deliveries so far that were the message's own: not this one.
        headers[PRIOR_DELIVERIES] = str(max(self.excused.own(msg) - 1, 0))
        headers["Nats-Msg-Id"] = f"park:{meta.stream}:{meta.sequence.stream}"  # parked twice (a crash): one copy
        headers[ORIGIN_HEADER] = subjects.origin_and_job(msg.subject)[0]  # published back under it
        try:
            await publish(self.js, subjects.parked(job), msg.data, headers=headers, attempts=PARK_ATTEMPTS, timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - the store is full or away: the message waits in its stream
            log.warning("could not park a paused job's results; retried later", job=job, error=repr(exc))
            self.excused.add(msg)
            await _quietly(msg.nak(delay=NAK_DELAY))
            return
        await _quietly(msg.ack())

    async def put_status(self, job: str) -> None:
        """Store `job`'s status with its pause (or without, once resumed), its progress as
        the sink last stored it."""
        pause = self.paused.get(job)
        try:
            try:
                status = m.job_status_decoder.decode((await self.status_kv.get(job)).value)
            except (NotFoundError, msgspec.DecodeError):
                status = m.JobStatus(job)
            now = time.time()
            status = self.mark(job, msgspec.structs.replace(status, updated_at=now, expires_at=now + job_retention()))
            await self.status_kv.put(job, m.encode_json(status))
        except Exception as exc:  # noqa: BLE001 - the next round's status carries it (`mark`)
            log.warning("status update failed", job=job, paused=pause is not None, error=repr(exc))

    def mark(self, job: str, status: m.JobStatus) -> m.JobStatus:
        """`status` with `job`'s pause (or none)."""
        pause = self.paused.get(job)
        return msgspec.structs.replace(status, paused=pause.reason if pause else None,
                                       paused_path=str(pause.path) if pause else None)

    async def recheck(self) -> None:
        """Probe the paused jobs due a check; resume those whose directory takes writes
        again. Also (after a restart, then every minute) resume jobs with parked results
        that are not paused here."""
        now = time.monotonic()
        for job, pause in list(self.paused.items()):
            if now - pause.checked < RECHECK:
                continue
            pause.checked = now
            try:
                await asyncio.to_thread(probe, pause.path, pause.needed)
            except OSError as exc:
                log.info("paused job still lacks a resource", job=job, error=str(exc))
                continue
            await self.resume(job)
        if now - self.parked_seen >= 60.0 or not self.parked_seen:
            self.parked_seen = now
            for job in await self.parked_jobs():
                if job not in self.paused and job not in self.moving:
                    self.move_back(job)

    async def resume(self, job: str) -> None:
        log.info("job resumed: its output takes writes again", job=job)
        self.paused.pop(job, None)
        await self.put_status(job)
        self.move_back(job)

    def move_back(self, job: str) -> None:
        if job not in self.moving:
            task = asyncio.get_running_loop().create_task(self.unpark(job))
            self.moving[job] = task
            task.add_done_callback(lambda _: self.moving.pop(job, None))

    async def unpark(self, job: str) -> int:
        """Move `job`'s parked results back to its results subject, oldest first, each
        deleted once the move is acked; stops if the job pauses again. Returns how many."""
        moved, seq = 0, 1
        try:
            while job not in self.paused:
                try:
                    raw = await self.js.get_msg(subjects.PARKED_STREAM.name, seq=seq, subject=subjects.parked(job),
                                                next=True)
                except NotFoundError:
                    break
                headers = {k: v for k, v in (raw.headers or {}).items() if k not in ("Nats-Msg-Id", ORIGIN_HEADER)}
                headers["Nats-Msg-Id"] = f"unpark:{raw.seq}"
                origin = (raw.headers or {}).get(ORIGIN_HEADER, "")
                if subjects.name_problem(origin) is not None:  # never a subject token unchecked
                    origin = "_unknown"  # (parked before origins): the sink's check refuses it, with the reason
                await publish(self.js, subjects.results(origin, job), raw.data or b"", headers=headers)
                await self.js.delete_msg(subjects.PARKED_STREAM.name, raw.seq)
                moved, seq = moved + 1, raw.seq + 1
        except Exception as exc:  # noqa: BLE001 - moved again at the next look (`recheck`)
            log.warning("moving parked results back failed; retried later", job=job, moved=moved, error=repr(exc))
            self.parked_seen -= 50.0  # looked at again in ~10 s
        if moved:
            log.info("parked results moved back", job=job, messages=moved)
        return moved

    async def parked_jobs(self) -> list[str]:
        """Jobs with parked results (from the stream's per-subject counts)."""
        try:
            info = await self.js.stream_info(subjects.PARKED_STREAM.name, subjects_filter=subjects.parked(">"))
        except Exception as exc:  # noqa: BLE001 - looked at again later
            log.warning("could not list parked results", error=repr(exc))
            return []
        return [subjects.job_from_subject(subject) for subject in (info.state.subjects or {})]

    async def stop(self) -> None:
        await stop_tasks(self.moving.values())  # a cancel alone can be lost (prefixflow/shared/process/tasks.py)


async def _quietly(settle: Awaitable[object]) -> None:
    try:
        await settle
    except Exception:  # noqa: BLE001 - a lost ack or nak: the message is redelivered after ack_wait
        pass
