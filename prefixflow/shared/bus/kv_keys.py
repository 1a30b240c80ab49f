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

from nats.errors import NoRespondersError
from nats.js.errors import APIError, ServiceUnavailableError

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
