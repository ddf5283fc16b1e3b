"""`dedup offsets show | rewind | skip | delete-group` against real Kafka and Postgres, as an
operator runs them.

Each test runs the CLI in a subprocess and checks what an operator sees (exit
code, output) and what the command leaves behind: the stored offsets, the
events, Kafka's committed offsets, and what a consumer then applies.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

import dedup
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.audit import json_out, run_cli_async
from dedup_dev.kafka import Topics

SHOW_FIELDS = {
    "group_id",
    "topic",
    "partition",
    "holder",
    "token",
    "next_offset",
    "acquired_at",
    "updated_at",
    "end_offset",
    "lag",
    "kafka_committed",
    "note",
}
MOVE_FIELDS = {
    "group_id",
    "topic",
    "partition",
    "status",
    "old_offset",
    "new_offset",
    "old_token",
    "new_token",
    "old_holder",
    "kafka_committed",
}
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def item(key: str) -> bytes:
    return orjson.dumps({"id": key})


async def produce_at(bootstrap_servers: str, topic: str, keys: range) -> None:
    """Records ``k<i>`` to partition 0, record i stamped T0 + i minutes."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
    await producer.start()
    try:
        for i in keys:
            stamp = int((T0 + datetime.timedelta(minutes=i)).timestamp() * 1000)
            await producer.send_and_wait(topic, item(f"k{i}"), partition=0, timestamp_ms=stamp)
    finally:
        await producer.stop()


async def partition_row(pool: Any, topic: str, partition: int = 0) -> Any:
    return await pool.fetchrow(
        "SELECT holder, token, next_offset FROM dedup.partitions"
        ' WHERE topic = $1 AND "partition" = $2',
        topic,
        partition,
    )


async def effect_keys(pool: Any) -> list[str]:
    return [r["key"] for r in await pool.fetch("SELECT key FROM effects ORDER BY id")]


async def offsets_cli(bootstrap_servers: str, dsn: str, *args: str) -> Any:
    return await run_cli_async("offsets", *args, "--bootstrap-servers", bootstrap_servers, dsn=dsn)


async def test_show_lists_stored_offsets_with_kafka_end_offsets_and_lag(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    group = f"g-{topic}"
    await pool.execute(support.EFFECTS)
    await helpers.produce(
        bootstrap_servers, topic, [(None, item(f"a{i}")) for i in range(6)], partition=0
    )
    await helpers.produce(
        bootstrap_servers, topic, [(None, item(f"b{i}")) for i in range(4)], partition=1
    )
    consumer = support.consumer(
        support.record_effects, topic, bootstrap_servers, pool, holder="shop-1"
    )
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: helpers.equal(kafka_support.committed(bootstrap_servers, group), {0: 6, 1: 4}),
            what="both partitions consumed and committed",
        )

    done = await offsets_cli(bootstrap_servers, dsn, "show", "--group", group, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json_out(done)
    assert doc["query"] == {
        "group": group,
        "topic": None,
        "bootstrap_servers": bootstrap_servers,
        "limit": 1000,
    }
    assert doc["found"] == 2 and doc["truncated"] is False
    assert all(set(row) == SHOW_FIELDS for row in doc["partitions"])
    assert [
        (
            r["partition"],
            r["holder"],
            r["token"],
            r["next_offset"],
            r["end_offset"],
            r["lag"],
            r["kafka_committed"],
        )
        for r in doc["partitions"]
    ] == [(0, "shop-1", 1, 6, 6, 0, 6), (1, "shop-1", 1, 4, 4, 0, 4)]

    # Lag grows with what is produced and not consumed yet.
    await helpers.produce(bootstrap_servers, topic, [(None, item("late"))], partition=1)
    done = await offsets_cli(bootstrap_servers, dsn, "show", "--group", group, "--topic", topic)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "partitions (2):"
    assert lines[1].split() == [
        "GROUP", "TOPIC", "PART", "HOLDER", "TOKEN", "NEXT_OFFSET", "END", "LAG", "KAFKA_COMMITTED"
    ]  # fmt: skip
    assert lines[2].split() == [group, topic, "0", "shop-1", "1", "6", "6", "0", "6"]
    assert lines[3].split() == [group, topic, "1", "shop-1", "1", "4", "5", "1", "4"]

    # Without Kafka: what Postgres holds, nothing else.
    done = await run_cli_async(
        "offsets", "show", "--group", group, "--bootstrap-servers", "", dsn=dsn
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].split()[-1] == "NEXT_OFFSET"
    done = await offsets_cli(bootstrap_servers, dsn, "show", "--group", "nope")
    assert (done.returncode, done.stdout.strip()) == (1, "no stored offsets match group=nope")


@pytest.mark.parametrize("to", [("--to-offset", "3"), ("--to-time", "2026-01-01T00:03:00Z")])
async def test_rewind_under_a_running_consumer_needs_yes_then_the_consumer_resumes_there(
    to: tuple[str, str], bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    group = f"g-{topic}"
    await pool.execute(support.EFFECTS)
    await produce_at(bootstrap_servers, topic, range(10))
    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    rewind = ("rewind", "--group", group, "--topic", topic, "--partition", "0", *to)
    async with support.running(consumer):
        await helpers.wait_for(lambda: support.handled(consumer, 10), what="all 10")
        before = await partition_row(pool, topic)
        assert before["next_offset"] == 10

        refused = await offsets_cli(bootstrap_servers, dsn, *rewind)
        assert refused.returncode == 1
        assert refused.stdout == ""
        assert f"dedup offsets: group {group} has 1 active member(s) in Kafka" in refused.stderr
        assert "Pass --yes to go ahead, or stop the group first" in refused.stderr
        assert await partition_row(pool, topic) == before, "nothing moved"

        done = await offsets_cli(
            bootstrap_servers, dsn, *rewind, "--yes", "--holder", "alice", "--format", "json"
        )
        assert done.returncode == 0, done.stderr
        assert f"group {group} is running" in done.stderr
        [row] = json_out(done)["partitions"]
        assert set(row) == MOVE_FIELDS
        assert (row["status"], row["old_offset"], row["new_offset"]) == ("rewound", 10, 3)
        assert (row["old_token"], row["new_token"]) == (before["token"], before["token"] + 1)
        assert row["old_holder"] == consumer.holder and row["kafka_committed"] is False

        # The consumer takes the partition back by itself and reads 3..9 again:
        # their keys are claimed, so they count as duplicates, nothing is applied twice.
        await helpers.wait_for(
            lambda: _at_least(consumer.stats, "duplicates", 7), what="offsets 3..9 read again"
        )
        after = await partition_row(pool, topic)
        assert after["holder"] == consumer.holder
        assert after["token"] == before["token"] + 2
        assert after["next_offset"] == 10
        await produce_at(bootstrap_servers, topic, range(10, 12))
        await helpers.wait_for(lambda: support.handled(consumer, 19), what="the 2 new ones")
        await helpers.wait_for(
            lambda: helpers.equal(kafka_support.committed(bootstrap_servers, group), {0: 12}),
            what="Kafka's committed offset at the end",
        )

    assert consumer.stats["duplicates"] == 7
    assert await effect_keys(pool) == [f"k{i}" for i in range(12)]
    event = await pool.fetchrow(
        "SELECT holder, token, resource, detail FROM dedup.events WHERE kind = 'offsets_rewound'"
    )
    assert event["holder"] == "dedup offsets rewind by alice"
    assert event["resource"] == f"{group}:{topic}:0"
    assert event["token"] == before["token"] + 1
    detail = event["detail"]
    assert (detail["old_offset"], detail["new_offset"]) == (10, 3)
    assert (detail["old_token"], detail["new_token"]) == (before["token"], before["token"] + 1)
    assert detail["old_holder"] == consumer.holder
    if to[0] == "--to-time":
        assert detail["to_time"] == "2026-01-01T00:03:00.000000+00:00"


async def test_a_skipped_range_is_never_applied_and_kafka_agrees_at_once(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    group = f"g-{topic}"
    await pool.execute(support.EFFECTS)
    await produce_at(bootstrap_servers, topic, range(5))
    first = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(first):
        await helpers.wait_for(lambda: support.handled(first, 5), what="the first 5")
    await produce_at(bootstrap_servers, topic, range(5, 15))

    done = await offsets_cli(
        bootstrap_servers, dsn,
        *("skip", "--group", group, "--topic", topic, "--partition", "0", "--to-offset", "10"),
        *("--holder", "bob", "--format", "json"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    [row] = json_out(done)["partitions"]
    assert (row["status"], row["old_offset"], row["new_offset"]) == ("skipped", 5, 10)
    assert row["kafka_committed"] is True, "the group is empty: Kafka gets the offset at once"
    assert await kafka_support.committed(bootstrap_servers, group) == {0: 10}
    stored = await partition_row(pool, topic)
    assert (stored["holder"], stored["next_offset"]) == ("dedup offsets skip by bob", 10)
    detail = await pool.fetchval("SELECT detail FROM dedup.events WHERE kind = 'offsets_skipped'")
    assert (detail["skipped_from"], detail["skipped_to"]) == (5, 10)

    second = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(second):
        await helpers.wait_for(lambda: support.handled(second, 5), what="offsets 10..14")
    assert await effect_keys(pool) == [f"k{i}" for i in (*range(5), *range(10, 15))]
    assert second.stats["messages"] == 5


async def test_moves_that_cannot_mean_one_thing_are_refused_and_move_nothing(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    group = f"g-{topic}"
    await produce_at(bootstrap_servers, topic, range(6))
    await pool.execute(
        'INSERT INTO dedup.partitions (group_id, topic, "partition", holder, token, next_offset)'
        " VALUES ($1, $2, 0, 'c-1', 4, 5)",
        group,
        topic,
    )
    where = ("--group", group, "--topic", topic)
    cases = [
        (
            ("rewind", *where, "--partition", "0", "--to-offset", "6"),
            f"dedup offsets: group {group} is at offset 5 on partition 0 of {topic}: rewind to 6 "
            "would move it forward; use `dedup offsets skip`",
        ),
        (
            ("skip", *where, "--partition", "0", "--to-offset", "99"),
            f"dedup offsets: --to-offset 99: partition 0 of {topic} holds offsets 0 to 6 (its end)",
        ),
        (
            ("rewind", *where, "--to-offset", "1"),
            "dedup offsets: --to-offset needs one --partition",
        ),
        (
            ("rewind", *where, "--partition", "3", "--to-time", "1h"),
            f"dedup offsets: --partition 3: topic {topic} has partitions 0 to 0",
        ),
        (
            ("skip", "--group", group, "--topic", "no-such-topic", "--to-time", "1h"),
            "dedup offsets: --topic no-such-topic: no such topic on Kafka",
        ),
    ]
    for args, message in cases:
        done = await offsets_cli(bootstrap_servers, dsn, *args)
        assert (done.returncode, done.stdout) == (2, ""), (args, done.stderr)
        assert done.stderr.startswith(message), (args, done.stderr)
    done = await run_cli_async(
        "offsets", "skip", *where, "--to-time", "1h", "--bootstrap-servers", "", dsn=dsn
    )
    assert done.returncode == 2
    assert "`offsets skip` needs Kafka" in done.stderr

    row = await partition_row(pool, topic)
    assert (row["holder"], row["token"], row["next_offset"]) == ("c-1", 4, 5)
    assert await pool.fetchval("SELECT count(*) FROM dedup.events") == 0


async def _at_least(stats: Any, name: str, n: int) -> bool:
    return bool(stats[name] >= n)


DELETE_FIELDS = {
    "group_id",
    "topic",
    "partition",
    "status",
    "old_offset",
    "old_token",
    "old_holder",
}


@contextlib.asynccontextmanager
async def committed_group(
    bootstrap_servers: str, topic: str, pool: Any
) -> AsyncIterator[dedup.IdempotentConsumer]:
    """The group ``g-<topic>`` running, once it applied ``topic``'s 3 records and committed
    them to Kafka; stopped on exit."""
    await pool.execute(support.EFFECTS)
    await produce_at(bootstrap_servers, topic, range(3))
    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: helpers.equal(kafka_support.committed(bootstrap_servers, f"g-{topic}"), {0: 3}),
            what="the group consumed and committed",
        )
        yield consumer


async def test_delete_group_refuses_a_running_group_then_deletes_it_in_kafka_and_postgres(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    group = f"g-{topic}"
    async with committed_group(bootstrap_servers, topic, pool) as consumer:
        running = await offsets_cli(bootstrap_servers, dsn, "delete-group", "--group", group)
        assert (running.returncode, running.stdout) == (1, "")
        assert running.stderr == (
            f"dedup offsets: group {group} has 1 active member(s) in Kafka, and Kafka deletes "
            "only an empty group (it answers NON_EMPTY_GROUP): stop its consumers first; "
            "nothing was deleted\n"
        )
        assert (await partition_row(pool, topic))["next_offset"] == 3

    args = ("delete-group", "--group", group, "--holder", "alice", "--format", "json")
    done = await offsets_cli(bootstrap_servers, dsn, *args)
    assert done.returncode == 0, done.stderr
    doc = json_out(done)
    assert doc["query"] == {"group": group, "keep_offsets": False}
    assert doc["kafka_group"] == "deleted"
    assert [set(r) for r in doc["partitions"]] == [DELETE_FIELDS]
    assert doc["partitions"][0] == {
        "group_id": group,
        "topic": topic,
        "partition": 0,
        "status": "deleted",
        "old_offset": 3,
        "old_token": 1,
        "old_holder": consumer.holder,
    }
    # Gone from both: Kafka's offsets and group, dedup's stored offsets; an event kept.
    assert await kafka_support.committed(bootstrap_servers, group) == {}
    assert await kafka_support.group_state(bootstrap_servers, group) == "Dead"
    assert await partition_row(pool, topic) is None
    event = await pool.fetchrow("SELECT * FROM dedup.events WHERE kind = 'offsets_deleted'")
    assert (event["resource"], event["holder"], event["token"]) == (
        f"{group}:{topic}:0",
        "dedup offsets delete-group by alice",
        1,
    )
    assert event["detail"] == {"old_offset": 3, "old_token": 1, "old_holder": consumer.holder}

    again = await offsets_cli(bootstrap_servers, dsn, "delete-group", "--group", group)
    assert (again.returncode, again.stdout) == (1, "")
    assert again.stderr == (
        f"dedup offsets: no group {group}: Kafka answers GROUP_ID_NOT_FOUND (the group id does "
        "not exist) and Postgres holds no offsets of it; nothing was deleted\n"
    )

    # Started again, the group reads from the start: each message is a duplicate.
    again_consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(again_consumer):
        await helpers.wait_for(
            lambda: _at_least(again_consumer.stats, "duplicates", 3), what="three duplicates"
        )
    assert await effect_keys(pool) == ["k0", "k1", "k2"]


async def test_delete_group_keep_offsets_deletes_it_in_kafka_only(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    group, other = f"g-{topic}", f"o-{topic}"
    async with committed_group(bootstrap_servers, topic, pool) as consumer:
        pass

    done = await offsets_cli(
        bootstrap_servers, dsn, "delete-group", "--group", group, "--keep-offsets"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"kafka: group {group} deleted, its committed offsets with it",
        "partitions (1):",
        f"GROUP{' ' * (len(group) - 3)}TOPIC{' ' * (len(topic) - 3)}PART  STATUS  OLD_OFFSET  "
        "OLD_TOKEN  OLD_HOLDER",
        f"{group}  {topic}  0     kept    3           1          {consumer.holder}",
    ]
    assert await kafka_support.committed(bootstrap_servers, group) == {}
    row = await partition_row(pool, topic)
    assert (row["holder"], row["token"], row["next_offset"]) == (consumer.holder, 1, 3)
    assert (
        await pool.fetchval("SELECT count(*) FROM dedup.events WHERE kind = 'offsets_deleted'") == 0
    )

    # A group only Kafka knows (committed by another tool): deleted there, nothing in Postgres.
    await kafka_support.reset(bootstrap_servers, other, topic, {0: 2})
    done = await offsets_cli(bootstrap_servers, dsn, "delete-group", "--group", other)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"kafka: group {other} deleted, its committed offsets with it\n"
        f"no stored offsets of group {other} in Postgres\n"
    )
    assert await kafka_support.committed(bootstrap_servers, other) == {}

    args = ("delete-group", "--group", other, "--keep-offsets")
    gone = await offsets_cli(bootstrap_servers, dsn, *args)
    assert (gone.returncode, gone.stderr) == (
        1,
        f"dedup offsets: no group {other}: Kafka answers GROUP_ID_NOT_FOUND (the group id does "
        "not exist); nothing was deleted\n",
    )
    no_kafka = await run_cli_async(
        "offsets", "delete-group", "--group", group, "--bootstrap-servers", "", dsn=dsn
    )
    assert no_kafka.returncode == 2
    assert "`offsets delete-group` deletes the group in Kafka" in no_kafka.stderr
