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
from prefixflow.shared.process import metrics
from prefixflow.shared.process.config import RouterConfig
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.control import SERVICE_VERSION, decode_request
from prefixflow.shared.bus.provision import provision
from prefixflow.services.router.failover import Failover
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import make_policy

log = structlog.get_logger()

ANSWERS_KEPT = 4096
"""Route answers kept for requests asked again (a bucketer retries within seconds)."""


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.fleet = Fleet(
            dead_after=cfg.dead_after,
            cap_tokens=cfg.replica_cap_tokens,
            history=cfg.history,
            cap_windows=cfg.cap_windows,
            start_windows=cfg.start_windows,
            lead_seconds=cfg.lead_seconds,
            hash_block_size=cfg.hash_block_size,
        )
        self.policy = make_policy(cfg.policy, slack_tokens=cfg.load_slack_tokens, split_factor=cfg.split_factor,
                                  hot_factor=cfg.hot_factor)
        self.routed = 0
        self.split = 0
        self.answered: collections.OrderedDict[tuple[str, str], m.RouteReply] = collections.OrderedDict()
        """The last `ANSWERS_KEPT` assignments by (bucketer, bucket id): a request asked
        again because its reply was lost gets the same answer, not a second assignment."""

    def on_status(self, status: m.EngineStatus) -> bool:
        """Apply a status; True when it freed room on a replica that can take work."""
        now = time.monotonic()
        r = self.fleet.replicas.get(status.replica)
        before = r.outstanding if r is not None else None
        written_off = self.fleet.written_off
        self.fleet.observe(
            status.replica,
            now,
            ready=status.ready,
            outstanding=status.outstanding_tokens,
            done_tokens=status.done_tokens,
            kv_blocks=status.kv_blocks,
            engine_block_size=status.block_size,
            window=status.window,
            cache_epoch=status.cache_epoch,
            ts=status.ts,
            decode_cost=status.decode_cost,
            adapters=status.adapters,
            lora_slots=status.lora_slots,
            loras=status.loras,
        )
        r = self.fleet.replicas[status.replica]
        if self.fleet.written_off > written_off:
            log.warning("work routed here never arrived: written off", replica=r.name,
                        tokens=self.fleet.written_off - written_off)
        freed = before is None or r.outstanding < before
        return freed and self.fleet.is_open(r, now)  # O(1): every replica reports often

    def on_cache_events(self, events: m.CacheEvents) -> None:
        self.fleet.apply_cache_events(events.replica, events.epoch, events.seq, events.ops)

    def decide(self, req: m.RouteRequest) -> m.RouteReply:
        """Route one request; a request asked again gets its first answer."""
        asked = (req.bucketer, req.bucket)
        if req.bucket and asked in self.answered:
            metrics.ROUTER_DECISIONS.labels(self.policy.name, "repeated").inc()
            return self.answered[asked]
        reply = self.route(req)
        if req.bucket and reply.assignments:
            self.answered[asked] = reply
            if len(self.answered) > ANSWERS_KEPT:
                self.answered.popitem(last=False)
        return reply

    def route(self, req: m.RouteRequest) -> m.RouteReply:
        now = time.monotonic()
        if req.parts:
            chosen = self.policy.route_parts(self.fleet, now, [(p.prompts, p.tokens, p.key, p.output, p.lora) for p in req.parts],
                                             req.key, defer=True)
        else:
            chosen = self.policy.route(self.fleet, now, req.prompts, req.tokens, req.key, req.output, req.lora,
                                       defer=True)
        if chosen is None:
            # Capped: retry once the next status may have freed room (~50 ms); none live: 1 s.
            metrics.ROUTER_DECISIONS.labels(self.policy.name, "retry_after").inc()
            return m.RouteReply(retry_after=1.0 if not self.fleet.live(now) else 0.05)
        self.routed += 1
        split = sum(r is not None for r, _ in chosen) > 1 and not req.parts  # one bucket over several replicas
        self.split += split
        self.count(chosen, split)
        if self.cfg.log_level == "debug":  # per decision: only build the fields when shown
            log.debug(
                "routed",
                prompts=req.prompts or sum(p.prompts for p in req.parts),
                # Each part's prefix as (blocks, last block hash in 4 hex digits).
                keys=[(len(k), f"{k[-1] & 0xFFFF:04x}" if k else "") for k in ([p.key for p in req.parts] or [req.key])],
                to=[(r.name if r else "(kept)", n) for r, n in chosen],
                outstanding={r.name: r.outstanding for r in self.fleet.replicas.values()},
            )
        costs = self.policy.last_costs
        return m.RouteReply([m.Assignment(r.name if r else "", n, cost) for (r, n), cost in zip(chosen, costs, strict=True)])

    def count(self, chosen: list, split: bool) -> None:
        """Metrics of one decision."""
        policy = self.policy.name
        metrics.ROUTER_DECISIONS.labels(policy, "split" if split else "routed").inc()
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
        """Route a batch with the current policy (failover re-places a dead replica's
        work): the assignments and what each was charged, or None."""
        chosen = self.policy.route(self.fleet, time.monotonic(), prompts, tokens, key, output, lora)
        return None if chosen is None else (chosen, self.policy.last_costs)

    def set_policy(self, name: str) -> None:
        """Switch policy at run time (benchmarks compare policies on warm engines);
        the prefix history is forgotten so the new policy starts clean."""
        self.policy = make_policy(name, slack_tokens=self.cfg.load_slack_tokens, split_factor=self.cfg.split_factor,
                                  hot_factor=self.cfg.hot_factor)
        self.fleet.forget_history()
        for r in self.fleet.replicas.values():
            r.routed_prompts = 0
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
        now = time.monotonic()
        room = self.fleet.room(now) if self.policy.eager else 0.0
        tokens = -1 if room == float("inf") else int(room)
        await request.respond(m.encode(m.RouterRoom(tokens, len(self.fleet.live(now)), self.policy.eager)))

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
        failover = Failover(self.fleet, self.place)
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
            now = time.monotonic()
            self.report_fleet(now)
            if now - last_report >= 5.0:
                last_report = now
                log.info(
                    "fleet",
                    policy=self.policy.name,
                    routed=self.routed,
                    split=self.split,
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
