"""Router: a nats.micro service (`prefixflow-router`) with three endpoints.

- `pfx.route` (`RouteRequest` -> `RouteReply`): the replica chosen by the configured
  policy for a bucket, or retry-after when every live replica is at its cap (or none is
  up yet).
- `pfx.router.room` (empty -> `RouterRoom`): the fleet's free room, for eager release.
- `pfx.router.policy` (`SetPolicy` -> `ControlReply`): switch policy at run time.

It listens to every engine's status (`pfx.status.*`) to know which replicas are live and
how loaded they are, and to the KV-cache changes of the engines that send them
(`pfx.cache.*`) to know which prefixes they hold. A handler that fails raises and
nats.micro answers the request with an error reply (`Nats-Service-Error`, code 400 for a
request that does not decode or names an unknown policy, 500 for anything else) and
counts it in the endpoint's stats (`prefixflow/shared/bus/control.py`); the subscription keeps
serving. A route reply never carries an error in its body (`RouteReply.error` is left to
older routers).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.service import Service
from nats.micro.request import Request, ServiceError

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.provenance import parse_key
from prefixflow.shared.process import metrics
from prefixflow.shared.process.config import RouterConfig
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.control import SERVICE_VERSION, decode_request
from prefixflow.shared.bus.provision import provision
from prefixflow.services.router.decision import Decider
from prefixflow.services.router.failover import Failover
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import Policy

log = structlog.get_logger()


class Router:
    """The I/O around the router's `Decider` (`decision.py`): NATS handlers, metrics, logs."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.core = Decider(cfg)

    @property
    def fleet(self) -> Fleet:
        return self.core.fleet

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def answered(self) -> collections.OrderedDict[tuple[str, str], m.RouteReply]:
        return self.core.answered

    def on_status(self, status: m.EngineStatus) -> bool:
        """Apply a status; True when it freed room on a replica that can take work."""
        written_off = self.fleet.written_off
        freed = self.core.observe(time.monotonic(), status)
        if self.fleet.written_off > written_off:
            log.warning("work routed here never arrived: written off", replica=status.replica,
                        tokens=self.fleet.written_off - written_off)
        return freed

    def on_cache_events(self, events: m.CacheEvents) -> None:
        self.core.on_cache_events(events)

    def decide(self, req: m.RouteRequest) -> m.RouteReply:
        """Route one request (`Decider.decide`), counted and logged."""
        decision = self.core.decide(time.monotonic(), req)
        policy = self.policy.name
        metrics.ROUTER_DECISIONS.labels(policy, decision.outcome).inc()
        if decision.chosen is not None:
            self.count(decision.chosen)
            if self.cfg.log_level == "debug":  # per decision: only build the fields when shown
                log.debug(
                    "routed",
                    prompts=req.prompts or sum(p.prompts for p in req.parts),
                    # Each part's prefix as (blocks, last block hash in 4 hex digits).
                    keys=[(len(k), f"{k[-1] & 0xFFFF:04x}" if k else "") for k in ([p.key for p in req.parts] or [req.key])],
                    to=[(r.name if r else "(kept)", n) for r, n in decision.chosen],
                    outstanding={r.name: r.outstanding for r in self.fleet.replicas.values()},
                )
        return decision.reply

    def count(self, chosen: list) -> None:
        """Metrics of one assignment."""
        policy = self.policy.name
        if self.policy.last_matches:
            hist = metrics.ROUTER_MATCH_BLOCKS.labels(policy)
            for blocks in self.policy.last_matches:
                hist.observe(blocks)
        for r, n in chosen:
            if r is None:
                metrics.ROUTER_KEPT_PROMPTS.inc(n)
            else:
                metrics.ROUTER_ROUTED_PROMPTS.labels(r.name).inc(n)

    def report_fleet(self, now: float) -> None:
        """Per-replica gauges (every tick of the main loop, not per status message)."""
        for r in list(self.fleet.replicas.values()):
            metrics.ROUTER_OUTSTANDING.labels(r.name).set(r.outstanding)
            metrics.ROUTER_LIVE.labels(r.name).set(1.0 if self.fleet.is_live(r, now) else 0.0)

    def place(self, prompts: int, tokens: int, key, output: int = -1, lora: str = "") -> tuple[list, list[int]] | None:
        """Failover's placement (`Decider.place`) on the monotonic clock."""
        return self.core.place(time.monotonic(), prompts, tokens, key, output, lora)

    def set_policy(self, name: str) -> None:
        self.core.set_policy(name)
        log.info("policy set", policy=name)

    async def on_route(self, request: Request) -> None:
        """`pfx.route`: decide where a bucket goes."""
        req = decode_request(m.route_request_decoder, request.data)
        try:
            reply = self.decide(req)
        except Exception as exc:
            # NOTE: logged and counted here, re-raised for nats.micro to answer and count.
            log.error("route request failed", error=repr(exc))
            metrics.ROUTER_DECISIONS.labels(self.policy.name, "error").inc()
            raise
        await request.respond(m.encode(reply))

    async def on_room(self, request: Request) -> None:
        """`pfx.router.room`: the fleet's free room (-1: unbounded)."""
        await request.respond(m.encode(self.core.room(time.monotonic())))

    async def on_policy(self, request: Request) -> None:
        """`pfx.router.policy`: switch policy; an unknown one is a 400 error reply."""
        name = decode_request(m.set_policy_decoder, request.data).name
        try:
            self.set_policy(name)
        except ValueError as exc:  # an unknown policy
            raise ServiceError("400", str(exc)) from None
        await request.respond(m.encode(m.ControlReply(True, name)))

    async def serve(self, nc: Client) -> Service:
        """The nats.micro service and its endpoints (stopped by the caller)."""
        service = await add_service(
            nc, name="prefixflow-router", version=SERVICE_VERSION, description="prefix-aware bucket routing"
        )
        await service.add_endpoint(name="route", subject=subjects.ROUTE, handler=self.on_route)
        await service.add_endpoint(name="room", subject=subjects.ROUTER_ROOM, handler=self.on_room)
        await service.add_endpoint(name="policy", subject=subjects.ROUTER_POLICY, handler=self.on_policy)
        return service

    async def run(self, stop: asyncio.Event) -> None:
        failover = Failover(self.fleet, self.place, parse_key(self.cfg.result_key))
        nc = await connect(self.cfg.nats_url, "router", on_reconnect=failover.on_reconnect)
        self.js = failover.js = nc.jetstream()
        await provision(self.js)

        async def on_status(msg: Msg) -> None:
            try:
                freed = self.on_status(m.engine_status_decoder.decode(msg.data))
            except Exception as exc:  # noqa: BLE001 - never let a bad status kill the sub
                log.warning("bad status message", error=repr(exc))
                return
            if freed:
                await nc.publish(subjects.ROUTER_ROOM_FREED, b"")

        async def on_cache_events(msg: Msg) -> None:
            try:
                self.on_cache_events(m.cache_events_decoder.decode(msg.data))
            except Exception as exc:  # noqa: BLE001 - never let a bad message kill the sub
                log.warning("bad cache events message", error=repr(exc))

        await nc.subscribe(subjects.ALL_STATUS, cb=on_status)
        await nc.subscribe(subjects.ALL_CACHE_EVENTS, cb=on_cache_events)
        service = await self.serve(nc)
        log.info("router ready", policy=self.cfg.policy)
        last_report = time.monotonic()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            try:
                await failover.tick()
            except Exception as exc:  # noqa: BLE001 - failover retries next tick
                log.warning("failover tick failed", error=repr(exc))
            self.core.touched()  # failover may have made replicas live again (a reconnect's grace)
            now = time.monotonic()
            self.report_fleet(now)
            if now - last_report >= 5.0:
                last_report = now
                log.info(
                    "fleet",
                    policy=self.policy.name,
                    routed=self.core.routed,
                    split=self.core.split,
                    live=[r.name for r in self.fleet.live(now)],
                    precise=sorted(self.fleet.precise),
                    cache_entries=len(self.fleet.blocks),
                    cache_gaps=self.fleet.cache_gaps,
                    written_off=self.fleet.written_off,
                    history_checks=dataclasses.asdict(self.fleet.history_checks),
                    outstanding={r.name: r.outstanding for r in self.fleet.replicas.values()},
                )
        for pull in failover.rescuing.values():
            await pull.unsubscribe()
        await service.stop()
        await close(nc)
