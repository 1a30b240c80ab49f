"""One structlog setup for every process.

Console rendering on a TTY, JSON lines otherwise (systemd, honcho piping, CI). Context
bound with `structlog.contextvars.bind_contextvars` (service, replica, job) is merged
into every line. Standard-library loggers (vLLM, nats) go through the same renderer.
"""

from __future__ import annotations

import logging
import sys

import structlog


def _quiet_tls_eof(record: logging.LogRecord) -> bool:
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def setup_logging(service: str, *, fmt: str = "auto", level: str = "info", **context: str) -> None:
    json_output = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # vLLM installs its own handler on the "vllm" logger: send it through ours instead.
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.handlers[:] = []
    vllm_logger.propagate = True
    # asyncio says this whenever a server closes a TLS connection that nats.py's protocol
    # handles (its eof_received returns True): noise on every TLS client's exit.
    logging.getLogger("asyncio").addFilter(_quiet_tls_eof)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **context)
