"""`prefixflow serve api`: the OpenAI Batch API (`prefixflow/batchapi/app.py`) on uvicorn, and
the batch runner (`prefixflow/batchapi/runner.py`) in the same event loop. On start it resumes
every batch not in a final state; SIGTERM stops the server and the runner (their
batches resume at the next start, from the records in the cluster)."""

from __future__ import annotations

import asyncio

import structlog
import uvicorn

from prefixflow.batchapi.app import make_app
from prefixflow.batchapi.runner import Runner
from prefixflow.batchapi.store import Store
from prefixflow.batchapi.quotas import Ledger, Limits, QuotaTable
from prefixflow.shared.api_keys import KeyRing
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.process.watched import Watched

log = structlog.get_logger()


def quota_table(cfg):
    """Each tenant's limits: the quota file (read again when it changes) over the
    `--quota-*` defaults. Raises ValueError/OSError for a bad file."""
    defaults = Limits(cfg.quota_stored_bytes, cfg.quota_open_batches, cfg.quota_queued_rows, cfg.quota_concurrent_jobs)
    if not cfg.quotas_file:
        table = QuotaTable(defaults)
        return lambda: table
    watched = Watched(cfg.quotas_file, lambda text: QuotaTable(defaults, text, cfg.quotas_file), "quotas")
    return watched.get


class Api:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        try:
            self.keys = KeyRing(cfg.api_keys, cfg.api_keys_file)
        except (ValueError, OSError) as exc:  # the reason, without a traceback (never a key)
            raise usage_error(f"prefixflow serve api: API keys: {exc}") from None
        try:
            table = quota_table(cfg)
        except (ValueError, OSError) as exc:
            raise usage_error(f"prefixflow serve api: quotas: {exc}") from None
        self.ledger = Ledger(lambda tenant: table()(tenant))

    async def count_usage(self, store: Store) -> None:
        """What every tenant holds now (its files' bytes, its open batches): the ledger's start."""
        for key in await store.file_ids():
            tenant, fid = key.split(".", 1)
            if (rec := await store.file(tenant, fid)) is not None:
                self.ledger.stored(tenant, rec.bytes)
        for rec in await store.batches():
            rows = rec.requests + rec.bad if rec.validated else rec.lines
            self.ledger.observe(rec.tenant, rec.batch["id"], rec.batch["status"], rows)

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, "api")
        js = nc.jetstream()
        await provision(js)
        store = await Store(nc, self.ledger, self.cfg.files_uri).open()
        await self.count_usage(store)
        runner = await Runner(store, self.cfg.nats_url, self.cfg, js, nc).open()
        await runner.resume_all()
        app = make_app(store, runner, self.keys, self.cfg, js, nc, self.ledger)
        server = uvicorn.Server(uvicorn.Config(app, host=self.cfg.host, port=self.cfg.port, log_level="warning",
                                               lifespan="off", access_log=False))
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if serving.done():
            await serving  # could not listen: say why
        log.info("api ready", url=f"http://{self.cfg.host}:{self.cfg.port}", tenants=sorted(set(self.keys.keys().values())) or
                 ["default (no API key asked)"])
        await stop.wait()
        server.should_exit = True
        await serving
        await runner.stop()
        await close(nc)


API_HELP = "the OpenAI Batch API (/v1/files, /v1/batches) over HTTP, with tenants; runs batches as jobs"


def add_parser(sub) -> None:
    from prefixflow.shared.process import config as cfgmod

    p = sub.add_parser("api", help=API_HELP, description=API_HELP)
    cfgmod.add_arguments(p, cfgmod.ApiConfig)


def serve(args=None) -> None:
    """`prefixflow serve api`: config from flags and `PFX_*`, then run until SIGTERM."""
    from prefixflow.shared.bus.connection import NatsOptions, configure
    from prefixflow.shared.process import config as cfgmod
    from prefixflow.shared.process import metrics
    from prefixflow.shared.process.logs import setup_logging
    from prefixflow.shared.process.supervise import run_service

    cfg = cfgmod.load(cfgmod.ApiConfig, args)
    configure(NatsOptions.from_config(cfg))
    setup_logging("api", fmt=cfg.log_format, level=cfg.log_level)
    service = Api(cfg)
    metrics.serve("api", cfg.metrics_port, [], addr=cfg.metrics_host)
    run_service(service.run)
