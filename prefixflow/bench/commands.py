"""`prefixflow bench ...`: every harness's subcommand, registered in one place."""

from __future__ import annotations


def add_parsers(sub) -> None:
    from prefixflow.bench.batch_limits import add_batch_limits_parser
    from prefixflow.bench.batching import add_batching_parser
    from prefixflow.bench.eta import add_eta_parser
    from prefixflow.bench.fairness import add_fairness_parser
    from prefixflow.bench.lora import add_lora_parser
    from prefixflow.bench.methods import add_methods_parser
    from prefixflow.bench.object_store import add_s3_parser
    from prefixflow.bench.peer_runs import add_peers_parser
    from prefixflow.bench.plan_accuracy import add_plan_accuracy_parser
    from prefixflow.bench.pipeline import add_pipeline_parser
    from prefixflow.bench.router import add_router_parser
    from prefixflow.bench.soak import add_soak_parser
    from prefixflow.torture.commands import add_parser as add_torture_parser

    add_methods_parser(sub)
    add_pipeline_parser(sub)
    add_router_parser(sub)
    add_peers_parser(sub)
    add_batching_parser(sub)
    add_soak_parser(sub)
    add_s3_parser(sub)  # object storage vs local files (docs/benchmarks.md)
    add_fairness_parser(sub)
    add_lora_parser(sub)
    add_batch_limits_parser(sub)
    add_eta_parser(sub)  # the ETA of a running job against its real end (docs/plan.md)
    add_plan_accuracy_parser(sub)  # `plan --calibrate` against a real run (docs/plan.md)
    add_torture_parser(sub, minutes=60.0)  # the long torture run (docs/torture.md)
