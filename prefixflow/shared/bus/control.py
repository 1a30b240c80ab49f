"""The control subjects' one error convention, both ends (nats.py `nats/micro`).

Every control subject is an endpoint of a nats.micro service: the router's route, room
and policy (`prefixflow/services/router/service.py`), an engine-worker's reset, scheduling and
status (`prefixflow/services/engine_worker/service.py`). A handler that fails raises: a bad request
as `ServiceError("400", why)` (`decode_request` does it for a body that does not decode),
anything else as it is. nats.micro's `Endpoint._handle_request` is then the one place that
answers with the error headers (`Nats-Service-Error`, `Nats-Service-Error-Code`: 400, or
500 and the exception's repr) and counts the error in the endpoint's stats
(`$SRV.STATS`: `num_errors`, `last_error`). A handler never calls `respond_error` itself:
micro counts only what is raised.

Callers send with `request` (or the helpers below it), which raises `ControlError` for an
error reply, so no caller reads an error out of a body. A reply with `ok` False
(`messages.ControlReply`) is a state, not an error: the engine is busy or rebuilding, ask
again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, ServiceError

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

T = TypeVar("T")

SERVICE_VERSION = "0.1.0"
"""The version the services give nats.micro (`$SRV.INFO`)."""


@dataclass
class ControlError(ServiceError):
    """An error reply of a control endpoint, raised on the caller's side: `code` (400: a
    bad request; 500: the handler failed) and `description` as the endpoint gave them."""

    subject: str = ""

    def __str__(self) -> str:
        return f"{self.subject}: {self.description} (error {self.code})"


def decode_request(decoder: msgspec.msgpack.Decoder[T], data: bytes) -> T:
    """A request body, or ServiceError 400 (a bad request) when it does not decode."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ServiceError("400", f"bad request: {exc}") from None


def check_reply(msg: Msg, subject: str = "") -> Msg:
    """`msg`, or ControlError when it is a nats.micro error reply."""
    headers = msg.headers or {}
    if ERROR_HEADER in headers or ERROR_CODE_HEADER in headers:
        raise ControlError(headers.get(ERROR_CODE_HEADER, ""), headers.get(ERROR_HEADER, ""), subject or msg.subject)
    return msg


async def request(nc: Client, subject: str, body: msgspec.Struct | bytes = b"", *, timeout: float) -> bytes:
    """Ask a control endpoint (`body` a message, sent as msgpack, or encoded already; by
    default an empty request): the reply's data, or ControlError for an error reply
    (nats.py's own errors when none comes)."""
    msg = await nc.request(subject, body if isinstance(body, bytes) else m.encode(body), timeout=timeout)
    return check_reply(msg, subject).data


async def set_policy(nc: Client, policy: str, timeout: float = 10.0) -> m.ControlReply:
    """Switch the router's policy; ControlError 400 for an unknown one."""
    return m.control_reply_decoder.decode(await request(nc, subjects.ROUTER_POLICY, m.SetPolicy(policy), timeout=timeout))


async def set_scheduling(nc: Client, replica: str, mode: str, timeout: float = 10.0) -> m.ControlReply:
    """Set a replica's scheduling; ControlError 400 for an unknown mode."""
    data = await request(nc, subjects.engine_scheduling(replica), m.SetScheduling(mode), timeout=timeout)
    return m.control_reply_decoder.decode(data)


async def reset_prefix_cache(nc: Client, replica: str, timeout: float = 30.0) -> m.ControlReply:
    """Ask a replica to empty its prefix cache: `ok`, or not yet (`busy`, `not ready`)."""
    return m.control_reply_decoder.decode(await request(nc, subjects.engine_reset(replica), timeout=timeout))


async def engine_status(nc: Client, replica: str, timeout: float = 10.0) -> m.EngineStatus:
    """A replica's status now."""
    return m.engine_status_decoder.decode(await request(nc, subjects.engine_status_request(replica), timeout=timeout))
