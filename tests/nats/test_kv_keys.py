"""`kv_keys`: a bucket's keys under a pattern, listed by the server (stream info with a
subject filter), without a consumer: what the batch API lists with under its grant."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.kv_keys import kv_keys

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]


def test_keys_under_a_pattern_without_a_consumer(nats_server):
    async def main() -> None:
        nc = await connect(nats_server.url, "tests")
        try:
            js = nc.jetstream()
            kv = await js.create_key_value(bucket="KEYS_TEST")
            assert await kv_keys(nc, "KEYS_TEST", "batch.>") == []
            for key in ("batch.alice.1", "batch.alice.2", "batch.alice2.1", "batch.bob.1", "file.alice.1"):
                await kv.put(key, b"x")
            await kv.put("batch.alice.1", b"y")  # a second revision: still one key
            await kv.delete("batch.bob.1")  # listed (its delete marker), a get says not found
            assert sorted(await kv_keys(nc, "KEYS_TEST", "batch.alice.>")) == ["batch.alice.1", "batch.alice.2"]
            assert sorted(await kv_keys(nc, "KEYS_TEST", "batch.*.1")) == ["batch.alice.1", "batch.alice2.1", "batch.bob.1"]
            assert len(await kv_keys(nc, "KEYS_TEST")) == 5
            assert (await js.stream_info("KV_KEYS_TEST")).state.consumer_count == 0
        finally:
            await close(nc)

    asyncio.run(main())
