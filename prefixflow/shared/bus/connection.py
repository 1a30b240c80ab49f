"""Connecting to NATS (retry until the server is up, then reconnect forever) and closing.

`url` may list several servers, comma separated, in order of preference (a node lists its
own server first): nats.py connects to the first that answers and fails over to the others
(and to servers it learns from the cluster) when it goes away.

Credentials and TLS (`NatsOptions`) come from the service's config: `prefixflow serve`
calls `configure()` once, so every connection of the process uses them; a client without
that (`prefixflow submit`) reads the same `PFX_NATS_*` variables from its environment.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields

import nats
import structlog
from nats.aio.client import Client

from prefixflow.shared.process.tasks import stop_task
from prefixflow.shared.wire import subjects

log = structlog.get_logger()


SHUTDOWN: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("pfx_shutdown", default=None)
"""The service's stop event (`prefixflow/shared/process/supervise.py` sets it): a SIGTERM while
`connect` still waits for a server ends the wait at once (`StoppedWhileConnecting`)."""


class StoppedWhileConnecting(Exception):
    """The process was asked to stop before any NATS server answered."""


TLS_CUT_OFF = ("APPLICATION_DATA_AFTER_CLOSE_NOTIFY", "UNEXPECTED_EOF", "EOF OCCURRED", "CONNECTION RESET")
"""TLS errors of a handshake the other side cut off (retrying can succeed), by their text."""


def tls_refusal(exc: BaseException) -> bool:
    """Is this a TLS failure that retrying cannot fix (a certificate not verified, TLS
    asked of a plain server or the other way round)? A handshake cut off by the server
    (`TLS_CUT_OFF`: its TLS timeout passed on a loaded machine, it restarted) is not."""
    text = str(exc).upper()
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE" in text:
        return True
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) or any(cut in text for cut in TLS_CUT_OFF):
        return False
    return isinstance(exc, ssl.SSLError) or "TLS" in text or "SSL" in text


@dataclass(frozen=True)
class NatsOptions:
    """How this process authenticates to NATS and how many replicas its streams get
    (the `nats_*`, `stream_replicas` and `job_retention` fields of `CommonConfig`)."""

    nats_user: str = ""
    nats_password: str = ""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    stream_replicas: int = 0
    """0: automatic (`provision.replicas_for`)."""
    job_retention: float = 0.0
    """Seconds job specs, statuses and dead letters are kept (0: `subjects.JOB_RETENTION`)."""
    provision: bool = True
    """Create or update streams and buckets at start-up (False: only check they exist; a
    fleet's services have no right to change them, `prefixflow cluster provision` does)."""

    @classmethod
    def from_config(cls, cfg: object) -> NatsOptions:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NatsOptions:
        environ = os.environ if environ is None else environ
        raw = {f.name: environ.get("PFX_" + f.name.upper(), "") for f in fields(cls)}
        raw["stream_replicas"] = int(raw["stream_replicas"] or 0)
        raw["job_retention"] = float(raw["job_retention"] or 0)
        raw["provision"] = raw["provision"].strip().lower() not in ("0", "false", "no", "off")
        return cls(**raw)

    def tls_context(self) -> ssl.SSLContext | None:
        if not self.nats_tls_ca and not self.nats_tls_cert:
            return None
        ctx = ssl.create_default_context(cafile=self.nats_tls_ca or None)
        if self.nats_tls_cert:
            ctx.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
        return ctx

    def connect_kwargs(self, urls: list[str]) -> dict:
        kwargs: dict = {}
        if self.nats_user:
            kwargs.update(user=self.nats_user, password=self.nats_password, inbox_prefix=subjects.inbox_prefix(self.nats_user))
        tls = self.tls_context()
        if tls is None and any(u.strip().startswith("tls://") for u in urls):
            tls = ssl.create_default_context()
        if tls is not None:
            kwargs["tls"] = tls
        return kwargs


_configured: NatsOptions | None = None


def configure(options: NatsOptions | None) -> None:
    """Set this process's NATS options (`prefixflow serve` does, from the service config);
    None: back to the environment."""
    global _configured
    _configured = options


def current_options() -> NatsOptions:
    return _configured if _configured is not None else NatsOptions.from_env()


def server_of(box: list[Client]) -> str | None:
    """host:port of the server the connection is on (for the logs)."""
    url = box[0].connected_url if box else None
    return url.netloc if url is not None else None


class NatsRefused(RuntimeError):
    """The server refused our credentials (retrying cannot help)."""


async def connect(
    url: str,
    name: str,
    *,
    wait: float = 120.0,
    on_reconnect: Callable[[], Awaitable[None] | None] | None = None,
    options: NatsOptions | None = None,
) -> Client:
    """Connect, retrying for up to `wait` seconds until the server is up (services may
    start before nats-server); once connected, reconnect forever. `on_reconnect` runs
    after every reconnect (the router uses it: silence during an outage is not death).
    `options`: credentials and TLS (default: `current_options()`). Refused credentials or
    an untrusted server certificate raise `NatsRefused` at once; no server within `wait`
    seconds raises `TimeoutError`."""
    opts = options or current_options()
    urls = [u.strip() for u in url.split(",") if u.strip()]
    auth_kwargs = opts.connect_kwargs(urls)
    nc_box: list[Client] = []
    """The connection, once made (the callbacks log its server)."""

    async def on_disconnect() -> None:
        if nc_box and nc_box[0].is_closed:
            return  # our own close(), not an outage
        log.warning("nats disconnected", server=server_of(nc_box))

    async def reconnected() -> None:
        log.info("nats reconnected", server=server_of(nc_box))
        if on_reconnect is not None:
            result = on_reconnect()
            if asyncio.iscoroutine(result):
                await result

    refused: list[str] = []
    """Why the servers refuse us (credentials, TLS): retrying cannot help."""
    refused_event = asyncio.Event()
    established = False

    def refuse(why: str) -> None:
        if not established and not refused:
            refused.append(why)
            refused_event.set()

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()
        if "authorization violation" in text or isinstance(exc, nats.errors.AuthorizationError):
            log.error("nats refused our credentials", user=opts.nats_user or None, url=url)
            who = f"user {opts.nats_user!r}" if opts.nats_user else "no credentials"
            refuse(f"authorization violation ({who}); set PFX_NATS_USER and PFX_NATS_PASSWORD "
                   "(`prefixflow cluster config` writes them)")
        elif tls_refusal(exc):
            log.error("nats TLS failed", url=url, error=str(exc))
            refuse(f"TLS failed ({exc}); PFX_NATS_TLS_CA must name the CA that signed the servers' "
                   "certificates, and a server that requires TLS needs it set")
        elif isinstance(exc, ssl.SSLError):
            # The server closed the handshake (its TLS timeout on a busy machine, a restart):
            # nats.py tries again, within `wait`.
            log.warning("nats TLS handshake cut off: retrying", url=url, error=str(exc))
        elif "permissions violation" in text:
            # A subject this user may not use: a bug in the grants (prefixflow/shared/wire/permissions.py)
            # or a client doing what its role forbids.
            log.warning("nats permission denied", user=opts.nats_user, error=str(exc))
        else:
            log.debug("nats error", error=repr(exc))

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        # NOTE: with max_reconnect_attempts=-1 nats.py keeps retrying inside connect()
        # (no server up yet, refused credentials, a certificate it cannot verify): the
        # error callback tells refusals apart, and `wait` bounds the rest.
        attempt = asyncio.ensure_future(
            nats.connect(
                servers=urls,
                name=name,
                connect_timeout=2,
                reconnect_time_wait=0.5,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                # NOTE: the list is in order of preference (the node's own server first).
                dont_randomize=True,
                disconnected_cb=on_disconnect,
                reconnected_cb=reconnected,
                error_cb=on_error,
                **auth_kwargs,
            )
        )
        watch = asyncio.ensure_future(refused_event.wait())
        stop = SHUTDOWN.get()
        stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            await asyncio.wait({attempt, watch, *([stopping] if stopping else [])}, timeout=max(deadline - loop.time(), 0.1),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if stopping is not None:
                stopping.cancel()
        if not attempt.done():
            # A single cancel can be lost (nats.py's connect loop retries inside a wait_for
            # on Python 3.11): a service stopped before its nats-server answered hung here.
            await stop_task(attempt)
            if stop is not None and stop.is_set():
                raise StoppedWhileConnecting(f"asked to stop before a NATS server answered at {url}")
            if refused:
                raise NatsRefused(f"{url}: {refused[0]}")
            raise TimeoutError(f"no NATS server answered at {url} within {wait:g} s")
        try:
            nc = attempt.result()
            established = True
            nc_box.append(nc)
            log.info("nats connected", server=server_of(nc_box), user=opts.nats_user or None, tls="tls" in auth_kwargs)
            return nc
        except nats.errors.AuthorizationError:
            refuse("authorization violation")
            raise NatsRefused(f"{url}: {refused[0]}") from None
        except (OSError, nats.errors.NoServersError, asyncio.TimeoutError) as exc:
            if loop.time() > deadline:
                raise
            log.info("waiting for nats-server", url=url, error=repr(exc))
            await asyncio.sleep(0.5)


async def close(nc: Client, *subs) -> None:
    """Unsubscribe pull subscriptions, then drain. (nats.py's drain waits its full
    timeout on an open pull subscription, which would blow the 5 s stop window.)"""
    for sub in subs:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - already closed
            pass
    try:
        await asyncio.wait_for(nc.drain(), 2.0)
    except Exception:  # noqa: BLE001 - drain timed out or connection gone: just close
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - nothing left to close
            pass


