"""The five services by name: their config class, description and how to build them.

`prefixflow serve NAME` and `python -m prefixflow.services.NAME` both come here. Each service is
imported only when it is run, so a process loads only its own dependencies (the
engine-worker alone imports vLLM).
"""

from __future__ import annotations

import argparse
import importlib

from prefixflow.shared.outcomes import reported
from prefixflow.shared.process import config as cfgmod

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
    "ingestor": ("prefixflow.services.ingestor.service", "Ingestor"),
    "bucketer": ("prefixflow.services.bucketer.service", "Bucketer"),
    "router": ("prefixflow.services.router.service", "Router"),
    "engine-worker": ("prefixflow.services.engine_worker.service", "EngineWorker"),
    "sink": ("prefixflow.services.sink.service", "Sink"),
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


def add_parsers(sub: argparse._SubParsersAction, only: str | None = None) -> None:
    """The five services' `serve` parsers (`only`: that one's alone)."""
    for name, cls in SERVICES.items():
        if only is not None and name != only:
            continue
        engine = name == "engine-worker"
        p = sub.add_parser(name, help=DESCRIPTIONS[name], description=DESCRIPTIONS[name], add_help=not engine)
        cfgmod.add_arguments(p, cls)
        if engine:  # vLLM's own engine arguments: listed by --help, parsed by vLLM's parser
            from prefixflow.services.engine_worker.engine_args import HelpWithEngineArgs

            p.add_argument("-h", "--help", action=HelpWithEngineArgs, help="show this help and vLLM's engine arguments")
            p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM engine arguments (after `--`, or loose)")


def load_config(name: str, args: argparse.Namespace | None = None):
    """The service's validated config; an engine-worker's loose vLLM arguments are added
    to its `engine_args`."""
    cfg = cfgmod.load(SERVICES[name], args)
    if name == "engine-worker" and getattr(args, "vllm_args", None):
        import shlex

        import msgspec

        from prefixflow.services.engine_worker.engine_args import split

        cfg = msgspec.structs.replace(cfg, engine_args=shlex.join(split(cfg.engine_args, args.vllm_args)))
    return cfg


def serve(name: str, args: argparse.Namespace | None = None) -> None:
    cfg = load_config(name, args)
    from prefixflow.shared.bus.connection import NatsOptions, configure
    from prefixflow.shared.process.logs import setup_logging
    from prefixflow.shared.process.supervise import run_service

    # Credentials, TLS and stream replicas for every NATS connection of this process.
    configure(NatsOptions.from_config(cfg))
    if name == "engine-worker" and cfg.engine == "vllm":
        from prefixflow.services.engine_worker.guard import start_guard

        start_guard()  # vLLM's engine core must not outlive this process (see guard.py)
    setup_logging(name, fmt=cfg.log_format, level=cfg.log_level, **log_context(name, cfg))
    service = make_service(name, cfg)
    serve_metrics(name, cfg, service)
    run_service(service.run)


def serve_metrics(name: str, cfg, service) -> None:
    """Prometheus metrics on `--metrics-port` (0: off). The engine-worker's are read from
    its status when scraped (vLLM's own `vllm:*` metrics join the same registry)."""
    from prefixflow.shared.process import metrics

    collectors = []
    if name == "engine-worker":
        collectors.append(metrics.EngineCollector(service.status, lambda: getattr(service, "rebuilds", 0)))
    metrics.serve(name, cfg.metrics_port, collectors, addr=cfg.metrics_host)


def main_for(name: str) -> None:
    """Entry point of `python -m prefixflow.services.<name>`."""
    parser = argparse.ArgumentParser(prog=f"python -m prefixflow.services.{name.replace('-', '_')}", description=DESCRIPTIONS[name])
    cfgmod.add_arguments(parser, SERVICES[name])
    args, loose = parser.parse_known_args()
    if loose and name != "engine-worker":
        parser.error(f"unrecognized arguments: {' '.join(loose)}")
    args.vllm_args = loose
    reported(lambda: serve(name, args))  # a bad configuration: `error: <why>`, exit code 2
