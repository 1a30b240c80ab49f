"""A key-value bucket's keys without a consumer.

nats.py's `KeyValue.keys()` creates an ordered consumer on the bucket's stream and
reads every entry of every key (all tenants' keys to list one tenant's). That needs
`$JS.API.CONSUMER.CREATE.KV_<bucket>` (a grant that lets its holder create any consumer
on the stream, durables included) and costs O(all keys). Here the server lists the
subjects of the bucket's stream that match a key pattern (`$JS.API.STREAM.INFO` with
`subjects_filter`), which a service that checks its buckets at start-up may already do,
and filters them itself: one request per 100,000 keys, O(matching keys).

A deleted or purged key is still listed (its last entry is the delete marker, until the
bucket drops it): a `get` of it says not found, which the caller treats as absent.
"""

from __future__ import annotations

import json

import asyncio

from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.errors import APIError, KeyNotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from prefixflow.shared.wire.permissions import JS_API, kv_stream

MAX_PAGES = 1000
"""Pages (of the server's 100,000 subjects each) read at most: a bound, not a limit
any bucket here reaches (its size is bounded)."""


async def kv_keys(nc, bucket: str, pattern: str = ">", *, timeout: float = 5.0) -> list[str]:
    """The keys of `bucket` matching `pattern` (a subject pattern over keys: `batch.>`,
    `file.alice.*`), in no particular order; [] for none."""
    prefix = f"$KV.{bucket}."
    subject = f"{JS_API}.STREAM.INFO.{kv_stream(bucket)}"
    keys: list[str] = []
    for _ in range(MAX_PAGES):
        request = {"subjects_filter": prefix + pattern, "offset": len(keys)}
        try:
            msg = await nc.request(subject, json.dumps(request).encode(), timeout=timeout)
        except NoRespondersError:
            raise ServiceUnavailableError from None
        resp = json.loads(msg.data)
        if "error" in resp:
            raise APIError.from_error(resp["error"])
        page = (resp.get("state") or {}).get("subjects") or {}
        keys += [s[len(prefix):] for s in page]
        # NOTE: `total` counts every matching subject; the server sends them in pages.
        if not page or len(keys) >= resp.get("total", 0):
            return keys
    raise RuntimeError(f"{bucket}: over {len(keys)} keys match {pattern!r}; listing stopped")


def bound(js, bucket: str) -> KeyValue:
    """`bucket` bound without asking the server. nats.py's `js.key_value` asks
    `$JS.API.STREAM.INFO` for the bucket's stream, which answers anyone it allows with
    every key's subject (every tenant's job ids): clients (`submit`, `status`, `cancel`,
    the Python API) may not ask it. Every bucket here is provisioned with direct gets
    (`provision.ensure_kv`), which name the key in the API subject, so a grant can hold a
    tenant to its own keys."""
    return KeyValue(name=bucket, stream=kv_stream(bucket), pre=f"$KV.{bucket}.", js=js, direct=True)


class NotProvisioned(RuntimeError):
    """The streams and buckets are not there (nobody ran `prefixflow cluster provision`)."""


async def wait_buckets(js, bucket: str, probe_key: str, *, attempts: int = 60, every: float = 0.5) -> None:
    """Wait until `bucket` answers a direct get of `probe_key` (one of the caller's own keys:
    found or not, the bucket is there; provisioning creates the buckets after the streams,
    so the streams are too). A client's check that the cluster is provisioned, with no
    stream info. Raises `NotProvisioned` after `attempts`."""
    kv = bound(js, bucket)
    for _ in range(attempts):
        try:
            await kv.get(probe_key)
            return
        except KeyNotFoundError:
            return
        except (NoRespondersError, NatsTimeout, asyncio.TimeoutError, ServiceUnavailableError):
            await asyncio.sleep(every)
    raise NotProvisioned(f"bucket {bucket} not there: run `prefixflow cluster provision` with admin credentials")
