"""The ``dedup offsets`` section of docs/reference/cli.md runs as written.

The page's story: the group ``billing`` consumed the topic ``orders``
(partition 0: 12 orders a minute apart from 2026-11-30 10:00 UTC; partition 1:
8 orders two minutes apart) and stopped; then 4 bad orders came to partition 1
(from 10:30), which must never be applied; at the end the group is deleted.
Its console blocks run in page order (see dedup_dev/docs.py); a block right
after the comment ``<!-- the group billing is running -->`` runs while the
group's consumer runs, which then must have taken its partitions back and
caught up.

Kafka is shared, so the test's group and topic get names of their own, as long
as the page's (the tables keep their widths), put in place of the page's names
in the commands and in what they must print.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import dedup
from dedup_dev import docs as docs_support
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "reference" / "cli.md"
RUNNING = "<!-- the group billing is running -->"
T0 = datetime.datetime(2026, 11, 30, 10, 0, tzinfo=datetime.UTC)
MINUTE = datetime.timedelta(minutes=1)
ORDERS = [(0, f"order-0-{i}", T0 + i * MINUTE) for i in range(12)] + [
    (1, f"order-1-{i}", T0 + 2 * i * MINUTE) for i in range(8)
]
BAD_ORDERS = [(1, f"bad-{i}", T0 + (30 + i) * MINUTE) for i in range(4)]


async def produce(bootstrap_servers: str, topic: str, orders: list[Any]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
    await producer.start()
    try:
        for partition, key, at in orders:
            await producer.send_and_wait(
                topic,
                orjson.dumps({"id": key}),
                partition=partition,
                timestamp_ms=int(at.timestamp() * 1000),
            )
    finally:
        await producer.stop()


def blocks(names: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(language, text with the test's names, runs with the group running?) of the section."""
    text = docs_support.section(PAGE.read_text(encoding="utf-8"), docs_support.CLI_OFFSETS)
    found = []
    for m in docs_support.BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        body = m[2]
        for documented, ours in names.items():
            body = body.replace(documented, ours)
        found.append((m[1], body, before == RUNNING))
    assert len(re.findall(r"^```", text, re.MULTILINE)) == 2 * len(found)
    return found


async def test_the_offsets_section_runs_as_written(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    group, topic = f"b-{uuid.uuid4().hex[:5]}", f"o-{uuid.uuid4().hex[:4]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        await admin.close()
    topics.created.append(topic)
    await pool.execute(support.EFFECTS)
    await produce(bootstrap_servers, topic, ORDERS)

    @contextlib.asynccontextmanager
    async def billing() -> AsyncIterator[dedup.IdempotentConsumer]:
        """The group's consumer, caught up with its partitions when it starts and stops."""
        consumer = dedup.IdempotentConsumer(
            support.record_effects,
            topics=[topic],
            group_id=group,
            bootstrap_servers=bootstrap_servers,
            pool=pool,
            holder=f"{group}-1",
            key=dedup.keys.json_field("id"),
            auto_offset_reset="earliest",
            install_signal_handlers=False,
        )

        ends = await kafka_support.end_offsets(bootstrap_servers, topic, 2)

        async def caught_up() -> bool:
            rows = await pool.fetch(
                'SELECT "partition", holder, next_offset FROM dedup.partitions WHERE group_id = $1',
                group,
            )
            return {r["partition"]: (r["holder"], r["next_offset"]) for r in rows} == {
                p: (consumer.holder, end) for p, end in ends.items()
            }

        async with support.running(consumer):
            await helpers.wait_for(caught_up, what="the group to own and finish its partitions")
            yield consumer
            await helpers.wait_for(caught_up, what="the group to take its partitions back")
        assert await kafka_support.committed(bootstrap_servers, group) == ends

    async with billing():
        pass
    await produce(bootstrap_servers, topic, BAD_ORDERS)
    env = docs_support.shell_env(dsn, bootstrap_servers)
    names = {"billing": group, "orders": topic, "localhost:9092": bootstrap_servers}
    found = blocks(names)
    assert any(running for _, _, running in found), f"no block marked {RUNNING}"
    for language, text, running in found:
        assert language == "console", f"no way to run a {language!r} block"
        async with billing() if running else contextlib.nullcontext():
            for command, expected in docs_support.console(text):
                actual = await asyncio.to_thread(docs_support.run, command, env)
                assert docs_support.expected_pattern(expected + "\n").fullmatch(actual), (
                    f"`{command}` printed:\n{actual}\nthe page says:\n{expected}"
                )
    # What the page says: rewound orders came again as duplicates; bad ones never applied.
    keys = {r["key"] for r in await pool.fetch("SELECT key FROM effects")}
    assert keys == {key for _, key, _ in ORDERS}
    assert await support.effect_counts(pool) == (len(ORDERS), len(ORDERS))
    # And the deleted group is gone from both: no stored offsets, nothing committed in Kafka.
    stored = "SELECT count(*) FROM dedup.partitions WHERE group_id = $1"
    assert await pool.fetchval(stored, group) == 0
    assert await kafka_support.committed(bootstrap_servers, group) == {}
