"""dedup_services.coupons against real Kafka and Postgres: one coupon per (user, campaign).

The idempotency key stops redelivered and replayed requests; the business
unique constraint stops a second request for the same coupon under a new id.
"""

from __future__ import annotations

import signal
from typing import Any

import orjson
from dedup_services import coupons

import dedup
from dedup_dev import effects as consumer_support
from dedup_dev import helpers
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics

DAY = "2026-11-30"


def request(rid: str | None, user: str, campaign: str, value: int = 500) -> dict[str, Any]:
    body: dict[str, Any] = {"user_id": user, "campaign": campaign, "value": value, "date": DAY}
    return body if rid is None else {"request_id": rid, **body}


STREAM = [
    request("r1", "u1", "bf"),
    request("r1", "u1", "bf"),  # redelivered
    request("r2", "u1", "bf"),  # a double click: a new id, the same coupon
    request("r3", "u2", "bf"),
    request("r4", "u1", "xmas", 200),
    request(None, "u2", "bf"),  # no id: keyed by its offset, still no second coupon
]


async def coupon_rows(pool: Any) -> list[tuple[str, str, str]]:
    rows = await pool.fetch(
        "SELECT user_id, campaign, request_key FROM coupons.coupons ORDER BY user_id, campaign"
    )
    return [tuple(r) for r in rows]


async def test_duplicates_new_ids_and_a_replay_issue_one_coupon_each(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await coupons.SERVICE.migrate(pool)
    sent = await service_support.produce_events(bootstrap_servers, topic, STREAM, key="user_id")
    consumer = coupons.SERVICE.consumer(
        topic=topic, bootstrap_servers=bootstrap_servers, pool=pool, install_signal_handlers=False
    )
    async with consumer_support.running(consumer):
        await helpers.wait_for(lambda: service_support.handled(consumer, sent), what="all sent")
        before = await pool.fetchval("SELECT count(*) FROM coupons.requests")
        sent += await service_support.produce_events(
            bootstrap_servers, topic, STREAM, key="user_id"
        )
        await helpers.wait_for(lambda: service_support.handled(consumer, sent), what="replay")

    assert await coupon_rows(pool) == [("u1", "bf", "r1"), ("u1", "xmas", "r4"), ("u2", "bf", "r3")]
    requests = await pool.fetch(
        "SELECT r.request_key, r.outcome, r.coupon_code = c.code AS same_coupon"
        "  FROM coupons.requests AS r JOIN coupons.coupons AS c USING (user_id, campaign)"
        " ORDER BY r.id"
    )
    outcomes = {r["request_key"]: r["outcome"] for r in requests}
    assert {k: v for k, v in outcomes.items() if k.startswith("r")} == {
        "r1": "issued",
        "r2": "already_issued",
        "r3": "issued",
        "r4": "issued",
    }
    assert all(r["same_coupon"] for r in requests), "a repeat gets the coupon already issued"
    # The replay added only the id-less request (a new offset is a new key): no coupon.
    assert before == 5 and len(requests) == 6
    assert consumer.stats["processed"] == 6
    assert consumer.stats["duplicates"] == sent - 6
    report = await dedup.reconcile(pool, coupons.RECONCILE, DAY)
    assert report.ok and (report.result.rows, report.result.total) == (3, 1200)


async def applied(pool: Any, n: int) -> bool:
    if await pool.fetchval("SELECT to_regclass('coupons.requests')") is None:
        return False  # the service has not applied its migration yet
    return bool(await pool.fetchval("SELECT count(*) = $1 FROM coupons.requests", n))


async def test_dedup_run_consumers_coupons(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    env = service_support.environment(dsn, bootstrap_servers, COUPONS_TOPIC=topic)
    async with service_support.child("run", "dedup_services.coupons", env=env) as service:
        await helpers.produce(
            bootstrap_servers,
            topic,
            [(b"u1", orjson.dumps(request(rid, "u1", "bf"))) for rid in ("a", "b", "a", "c")],
        )
        await helpers.wait_for(lambda: applied(pool, 3), what="three requests applied")
        assert await service.stop(signal.SIGTERM) == 0, await service.stderr()
    assert await coupon_rows(pool) == [("u1", "bf", "a")]
