"""The five services by name: their config class, description and how to build them.

`prefixflow serve NAME` and `python -m services.NAME` both come here. Each service is
imported only when it is run, so a process loads only its own dependencies (the
engine-worker alone imports vLLM).
"""

from __future__ import annotations

import argparse
import importlib

from shared.process import config as cfgmod
from shared.process.logs import setup_logging
from shared.process.supervise import run_service

SERVICES: dict[str, type] = {
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
}

_CLASSES = {
    "ingestor": ("services.ingestor.service", "Ingestor"),
    "bucketer": ("services.bucketer.service", "Bucketer"),
    "router": ("services.router.service", "Router"),
    "engine-worker": ("services.engine_worker.service", "EngineWorker"),
    "sink": ("services.sink.service", "Sink"),
}


def make_service(name: str, cfg):
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)(cfg)


def log_context(name: str, cfg) -> dict[str, str]:
    if name == "engine-worker":
        return {"replica": cfg.replica}
    if name == "bucketer":
        return {"node": cfg.node}
    return {}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, cls in SERVICES.items():
        p = sub.add_parser(name, help=DESCRIPTIONS[name], description=DESCRIPTIONS[name])
        cfgmod.add_arguments(p, cls)


def serve(name: str, args: argparse.Namespace | None = None) -> None:
    cfg = cfgmod.load(SERVICES[name], args)
    if name == "engine-worker" and cfg.engine == "vllm":
        from services.engine_worker.guard import start_guard

        start_guard()  # vLLM's engine core must not outlive this process (see guard.py)
    setup_logging(name, fmt=cfg.log_format, level=cfg.log_level, **log_context(name, cfg))
    run_service(make_service(name, cfg).run)


def main_for(name: str) -> None:
    """Entry point of `python -m services.<name>`."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name.replace('-', '_')}", description=DESCRIPTIONS[name])
    cfgmod.add_arguments(parser, SERVICES[name])
    serve(name, parser.parse_args())
