"""`prefixflow cluster provision`: the operator's step that creates (or brings up to
date) every stream, key-value bucket and object store of a fleet, with the admin user.
A fleet's services may not (`PFX_PROVISION=false` in the env `cluster config` writes, and
no grant for it): they only check (`prefixflow/shared/bus/provision.py`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os


def add_provision_parser(sub) -> None:
    p = sub.add_parser(
        "provision",
        help="create or update the streams and buckets (admin credentials)",
        description="Create (or bring up to date) every JetStream stream, key-value bucket and object store, "
        "with the admin user: a fleet's services may only check them. Reads PFX_NATS_URL, the admin's "
        "PFX_NATS_USER/PFX_NATS_PASSWORD and PFX_NATS_TLS_CA from the environment "
        "(`set -a; . clients/env; . clients/admin.env`).",
    )
    p.add_argument("--nats", default="", help="server URL(s) (default PFX_NATS_URL)")
    p.add_argument("--stream-replicas", type=int, default=None, help="replicas (default PFX_STREAM_REPLICAS; 0: automatic)")
    p.add_argument("--job-retention", type=float, default=None, help="seconds job records are kept (default PFX_JOB_RETENTION)")
    p.set_defaults(fn=cmd_provision)


def cmd_provision(args: argparse.Namespace) -> None:
    from prefixflow.shared.bus.connection import NatsOptions, close, configure, connect
    from prefixflow.shared.bus.provision import provision

    options = NatsOptions.from_env()
    options = dataclasses.replace(
        options, provision=True,
        stream_replicas=options.stream_replicas if args.stream_replicas is None else args.stream_replicas,
        job_retention=options.job_retention if args.job_retention is None else args.job_retention)
    configure(options)
    url = args.nats or os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222")

    async def main() -> list[tuple[str, int]]:
        nc = await connect(url, "provision", options=options, wait=30)
        try:
            js = nc.jetstream()
            await provision(js, create=True)
            from prefixflow.shared.wire.permissions import ALL_STREAMS

            return [(name, (await js.stream_info(name)).config.num_replicas or 1) for name in ALL_STREAMS]
        finally:
            await close(nc)

    for name, replicas in asyncio.run(main()):
        print(f"{name}: {replicas} replica(s)")
