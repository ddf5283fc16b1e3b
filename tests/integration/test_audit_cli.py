"""`dedup audit`, `dedup events` and `dedup dead-letters` against a real database and Kafka.

Rows are seeded as the consumer and the task runner write them; each test runs
the CLI in a subprocess and checks what an operator sees: exit code and output.
"""

from __future__ import annotations

import base64
import datetime
import signal
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

import dedup
from dedup import _handler as handler_
from dedup.operations import _audit as audit_ops
from dedup_dev import audit as audit_support
from dedup_dev import effects as support
from dedup_dev import helpers, task_jobs, task_worker
from dedup_dev.audit import (
    UTC,
    add_dead_letter,
    add_event,
    add_key,
    json_out,
    payload_hash,
    run_cli,
)
from dedup_dev.kafka import Topics

# The documented field names (docs/reference/cli.md): a contract.
PROCESSED_FIELDS = {
    "namespace",
    "idempotency_key",
    "topic",
    "partition",
    "offset",
    "token",
    "payload_hash",
    "status",
    "first_seen",
    "processed_at",
    "duplicates",
    "conflicts",
    "last_duplicate_at",
}
DEAD_LETTER_FIELDS = {
    "id",
    "namespace",
    "group_id",
    "topic",
    "partition",
    "offset",
    "timestamp_ms",
    "idempotency_key",
    "reason",
    "error",
    "attempts",
    "token",
    "created_at",
    "replayed_at",
}
EVENT_FIELDS = {
    "id",
    "at",
    "subject",
    "kind",
    "namespace",
    "key",
    "resource",
    "holder",
    "token",
    "from_state",
    "to_state",
    "trace_id",
    "detail",
}
T0 = datetime.datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


async def test_audit_by_key_finds_it_in_every_namespace_unless_one_is_named(
    dsn: str, pool: Any
) -> None:
    await add_key(pool, "pay-1", namespace="payments", offset=41, token=3, value=b'{"a":1}')
    await add_key(pool, "pay-1", namespace="refunds", topic="refunds", offset=7, duplicates=2)
    await add_key(pool, "pay-2", namespace="payments", offset=42)

    everywhere = json_out(run_cli("audit", "--key", "pay-1", "--format", "json", dsn=dsn))
    assert [r["namespace"] for r in everywhere["processed"]] == ["payments", "refunds"]
    assert everywhere["found"] == 2 and everywhere["truncated"] is False
    row = everywhere["processed"][0]
    assert set(row) == PROCESSED_FIELDS
    assert row["idempotency_key"] == "pay-1"
    assert (row["topic"], row["partition"], row["offset"], row["token"]) == ("payments", 0, 41, 3)
    assert row["payload_hash"] == payload_hash(b'{"a":1}').hex()
    assert datetime.datetime.fromisoformat(row["first_seen"]).utcoffset() == datetime.timedelta()

    one = run_cli("audit", "--key", "pay-1", "--namespace", "refunds", dsn=dsn)
    assert one.returncode == 0, one.stderr
    lines = one.stdout.splitlines()
    assert lines[0] == "processed keys (1):"
    header, data = lines[1], lines[2]
    assert header.split()[:6] == ["NAMESPACE", "KEY", "TOPIC", "PART", "OFFSET", "TOKEN"]
    assert data.split()[:6] == ["refunds", "pay-1", "refunds", "0", "7", "1"]
    # Aligned: every column starts where its heading does.
    for heading, value in (("OFFSET", "7"), ("DUPS", "2")):
        assert data[header.index(heading) :].startswith(value)


async def test_audit_by_offset_shows_the_key_and_the_dead_letter_at_that_offset(
    dsn: str, pool: Any
) -> None:
    await add_key(pool, "pay-9", topic="payments", partition=2, offset=100)
    await add_key(pool, "pay-8", topic="payments", partition=1, offset=100)
    await add_dead_letter(pool, topic="payments", partition=2, offset=100, reason="bad json")

    done = run_cli(
        "audit", "--topic", "payments", "--partition", "2", "--offset", "100", "--format", "json",
        dsn=dsn,
    )  # fmt: skip
    doc = json_out(done)
    assert done.returncode == 0
    assert [r["idempotency_key"] for r in doc["processed"]] == ["pay-9"]
    assert [r["reason"] for r in doc["dead_letters"]] == ["bad json"]
    assert set(doc["dead_letters"][0]) == DEAD_LETTER_FIELDS
    assert doc["query"] == {
        "key": None,
        "namespace": None,
        "topic": "payments",
        "partition": 2,
        "offset": 100,
        "since": None,
        "until": None,
        "status": None,
        "limit": 1000,
    }


async def test_audit_of_a_window_filters_by_status_and_keeps_its_bounds(
    dsn: str, pool: Any
) -> None:
    await add_key(pool, "before", first_seen=T0 - datetime.timedelta(microseconds=1))
    await add_key(pool, "at-start", first_seen=T0, duplicates=1, last_duplicate_at=T0)
    await add_key(pool, "inside", first_seen=T0 + datetime.timedelta(minutes=5), conflicts=1)
    await add_key(pool, "plain", first_seen=T0 + datetime.timedelta(minutes=6))
    await add_key(pool, "at-end", first_seen=T0 + datetime.timedelta(hours=1))
    await add_dead_letter(pool, created_at=T0 + datetime.timedelta(minutes=7), reason="poison")
    window = ["--since", "2026-11-30T10:00:00Z", "--until", "2026-11-30 11:00"]

    everything = json_out(run_cli("audit", *window, "--format", "json", dsn=dsn))
    keys = [r["idempotency_key"] for r in everything["processed"]]
    assert keys == ["at-start", "inside", "plain"]
    assert [r["reason"] for r in everything["dead_letters"]] == ["poison"]
    assert everything["query"]["since"] == "2026-11-30T10:00:00.000000+00:00"

    args = ("audit", *window, "--status", "duplicate,conflict", "--format", "json")
    suppressed = json_out(run_cli(*args, dsn=dsn))
    assert [r["idempotency_key"] for r in suppressed["processed"]] == ["at-start", "inside"]
    assert suppressed["dead_letters"] == []

    args = ("audit", *window, "--status", "dead_lettered", "--limit", "1", "--format", "json")
    dead = json_out(run_cli(*args, dsn=dsn))
    assert (dead["processed"], len(dead["dead_letters"]), dead["truncated"]) == ([], 1, False)

    limited = json_out(run_cli("audit", *window, "--limit", "2", "--format", "json", dsn=dsn))
    assert len(limited["processed"]) == 2 and limited["truncated"] is True


async def test_an_audit_that_finds_nothing_says_so_and_exits_1(dsn: str, pool: Any) -> None:
    await add_key(pool, "pay-1")
    table = run_cli("audit", "--key", "pay-404", "--namespace", "payments", dsn=dsn)
    assert table.returncode == 1
    assert table.stdout.strip() == (
        "no processed keys or dead letters match key=pay-404, namespace=payments"
    )
    doc = json_out(run_cli("audit", "--key", "pay-404", "--format", "json", dsn=dsn))
    assert (doc["processed"], doc["dead_letters"], doc["found"]) == ([], [], 0)
    events = run_cli("events", "--resource", "nowhere:0", dsn=dsn)
    assert (events.returncode, events.stdout.strip()) == (1, "no events match resource=nowhere:0")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["audit", "--key", "k", "--bogus"], "unrecognized arguments: --bogus"),
        (["audit", "--topic", "t", "--partition", "-1", "--offset", "0"], "argument --partition"),
        (["audit", "--topic", "t", "--offset", "3"], "--topic, --partition and --offset go"),
        (["audit", "--since", "yesterday"], "invalid time 'yesterday'"),
        (["audit", "--key", "k", "--status", "done"], "invalid status 'done'"),
        (["audit", "--key", "k", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
        (["audit"], "say what to audit"),
        (["audit", "--since", "2026-12-01", "--until", "2026-11-01"], "is not before --until"),
        (["events", "--task", "t", "--key", "k"], "give the business key as --business-key"),
        (["events", "--business-key", "k"], "--business-key goes with --task"),
        (["events"], "say whose events"),
        (["dead-letters", "show", "x"], "argument id: invalid value 'x'"),
        (["dead-letters", "frobnicate"], "invalid choice: 'frobnicate'"),
        (["purge", "--older-than", "30x"], "invalid duration '30x'"),
        (["audit", "--key", "k", "--schema", "No-Such"], "invalid schema name 'No-Such'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_input(args: list[str], message: str) -> None:
    # Checked before connecting: this database does not exist.
    done = run_cli(*args, dsn="postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr
    assert done.stdout == ""


def test_a_missing_database_setting_or_schema_is_named(dsn: str) -> None:
    no_dsn = run_cli("audit", "--key", "k")
    assert no_dsn.returncode == 2
    assert "pass --dsn" in no_dsn.stderr
    for command in (["audit", "--key", "k"], ["purge", "--older-than", "30d"]):
        unmigrated = run_cli(*command, "--schema", "elsewhere", dsn=dsn)
        assert unmigrated.returncode == 2
        assert "no dedup tables in schema 'elsewhere'" in unmigrated.stderr


async def test_events_of_a_task_show_a_takeover_with_both_tokens(dsn: str, pool: Any) -> None:
    resource = "task:statements:2026-11-30"
    task = {"namespace": "statements", "key": "2026-11-30", "resource": resource}
    await add_event(pool, "task", "task_started", holder="a", token=7, to_state="running", **task)
    await add_event(
        pool,
        "task",
        "task_taken_over",
        holder="b",
        token=8,
        from_state="running",
        to_state="running",
        detail={"previous_token": 7, "previous_holder": "a"},
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        **task,
    )
    await add_event(pool, "task", "task_started", namespace="statements", key="2026-12-01")
    await add_event(pool, "message", "conflict", namespace="statements", key="2026-11-30")

    args = ("events", "--task", "statements", "--business-key", "2026-11-30", "--format", "json")
    doc = json_out(run_cli(*args, dsn=dsn))
    assert [e["kind"] for e in doc["events"]] == ["task_started", "task_taken_over"]
    takeover = doc["events"][1]
    assert set(takeover) == EVENT_FIELDS
    assert (takeover["token"], takeover["detail"]["previous_token"]) == (8, 7)
    assert (takeover["holder"], takeover["detail"]["previous_holder"]) == ("b", "a")
    assert takeover["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert doc["query"]["task"] == "statements"

    only = run_cli("events", "--task", "statements", "--kind", "task_taken_over", dsn=dsn)
    assert only.returncode == 0
    assert only.stdout.splitlines()[0] == "events (1):"
    assert '{"previous_token":7,"previous_holder":"a"}' in only.stdout

    by_resource = json_out(run_cli("events", "--resource", resource, "--format", "json", dsn=dsn))
    assert [e["token"] for e in by_resource["events"]] == [7, 8]


async def test_events_by_key_span_namespaces(dsn: str, pool: Any) -> None:
    await add_event(pool, "message", "dead_lettered", namespace="payments", key="pay-1", token=2)
    await add_event(pool, "message", "conflict", namespace="refunds", key="pay-1", token=5)
    await add_event(pool, "message", "conflict", namespace="payments", key="pay-2")

    doc = json_out(run_cli("events", "--key", "pay-1", "--format", "json", dsn=dsn))
    assert [(e["namespace"], e["kind"]) for e in doc["events"]] == [
        ("payments", "dead_lettered"),
        ("refunds", "conflict"),
    ]
    args = ("events", "--key", "pay-1", "--namespace", "refunds", "--format", "json")
    assert [e["token"] for e in json_out(run_cli(*args, dsn=dsn))["events"]] == [5]


async def test_dead_letters_list_and_show_the_whole_record(dsn: str, pool: Any) -> None:
    first = await add_dead_letter(
        pool,
        offset=5,
        key=b"acct-7",
        value=b'{"amount": 12',
        headers=[("traceparent", b"00-4bf9-01"), ("blob", b"\x00\xff"), ("blob", b"2")],
        idempotency_key="pay-5",
        reason="bad json",
    )
    await add_dead_letter(pool, offset=6, replayed_at=T0, reason="handler failed")

    listed = json_out(run_cli("dead-letters", "list", "--format", "json", dsn=dsn))
    assert [d["offset"] for d in listed["dead_letters"]] == [5, 6]
    assert set(listed["dead_letters"][0]) == DEAD_LETTER_FIELDS
    args = ("dead-letters", "list", "--pending", "--format", "json")
    assert [d["id"] for d in json_out(run_cli(*args, dsn=dsn))["dead_letters"]] == [first]

    shown = json_out(run_cli("dead-letters", "show", str(first), "--format", "json", dsn=dsn))
    whole = shown["dead_letters"][0]
    assert set(whole) == DEAD_LETTER_FIELDS | {"key", "value", "headers"}
    assert base64.b64decode(whole["key"]) == b"acct-7"
    assert base64.b64decode(whole["value"]) == b'{"amount": 12'
    assert [(h["name"], base64.b64decode(h["value"])) for h in whole["headers"]] == [
        ("traceparent", b"00-4bf9-01"),
        ("blob", b"\x00\xff"),
        ("blob", b"2"),
    ]

    table = run_cli("dead-letters", "show", str(first), dsn=dsn)
    assert table.returncode == 0
    assert 'value            {"amount": 12' in table.stdout
    assert "headers          traceparent=00-4bf9-01, blob=base64:AP8=, blob=2" in table.stdout

    missing = run_cli("dead-letters", "show", "999", dsn=dsn)
    assert (missing.returncode, missing.stdout.strip()) == (1, "no dead letter with id 999")


async def test_replay_produces_the_original_record_again_and_marks_it(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=3)
    headers = [("traceparent", b"00-4bf9-01"), ("blob", b"\x00\xff"), ("blob", b"2")]
    dead = await add_dead_letter(
        pool,
        topic=topic,
        partition=2,
        offset=17,
        key=b"acct-7",
        value=b'{"payment_id": "pay-17"}',
        headers=headers,
        idempotency_key="pay-17",
    )
    env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}

    done = run_cli("dead-letters", "replay", str(dead), "--format", "json", dsn=dsn, env=env)
    assert done.returncode == 0, done.stderr
    replayed = json_out(done)["replayed"]
    assert [(r["id"], r["partition"], r["offset"]) for r in replayed] == [(dead, 2, 17)]

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 2)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        record = await consumer.getone()
    finally:
        await consumer.stop()
    assert (record.key, record.value) == (b"acct-7", b'{"payment_id": "pay-17"}')
    assert list(record.headers) == headers
    assert record.offset == replayed[0]["replayed_offset"]

    row = await pool.fetchrow("SELECT replayed_at FROM dedup.dead_letters WHERE id = $1", dead)
    assert row["replayed_at"] is not None
    event = await pool.fetchrow("SELECT * FROM dedup.events WHERE kind = 'replayed'")
    assert (event["namespace"], event["key"], event["resource"]) == (
        "payments",
        "pay-17",
        f"{topic}:2",
    )
    assert event["detail"] == {"dead_letter_id": dead, "offset": 17, "replayed_offset": 0}

    again = run_cli("dead-letters", "replay", str(dead), "999", dsn=dsn, env=env)
    assert again.returncode == 1
    assert "replayed already at" in again.stdout
    assert "no dead letter with this id" in again.stdout
    forced = run_cli("dead-letters", "replay", str(dead), "--again", dsn=dsn, env=env)
    assert forced.returncode == 0, forced.stderr
    assert await pool.fetchval("SELECT count(*) FROM dedup.events WHERE kind = 'replayed'") == 2


async def test_replay_to_a_topic_that_is_gone_says_so_and_changes_nothing(
    dsn: str, pool: Any, bootstrap_servers: str
) -> None:
    dead = await add_dead_letter(pool, topic="deleted-meanwhile-0b3f")
    env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}
    done = run_cli("dead-letters", "replay", str(dead), "--format", "json", dsn=dsn, env=env)
    assert done.returncode == 1
    reason = "topic 'deleted-meanwhile-0b3f' is not in Kafka (UnknownTopicOrPartitionError)"
    assert json_out(done)["skipped"] == [{"id": dead, "reason": reason}]
    assert done.stderr == ""
    row = await pool.fetchrow("SELECT replayed_at FROM dedup.dead_letters WHERE id = $1", dead)
    assert row["replayed_at"] is None
    assert await pool.fetchval("SELECT count(*) FROM dedup.events") == 0


async def test_a_tombstone_and_a_null_key_are_dead_lettered_and_replayed_as_they_came(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
    await producer.start()
    try:
        # A delete on a compacted topic (no JSON to key it by), and a broken event
        # with no Kafka key and a header whose value is null.
        await producer.send_and_wait(topic, None, key=b"acct-9")
        await producer.send_and_wait(topic, b"{broken", key=None, headers=[("h", None)])
    finally:
        await producer.stop()
    consumer = audit_support.consumer(support.record_effect, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: _at_least(consumer.stats["dead_lettered"], 2), what="two dead letters"
        )
    rows = await pool.fetch('SELECT * FROM dedup.dead_letters ORDER BY "offset"')
    stored = [(r["key"], r["value"], r["header_names"], r["header_values"]) for r in rows]
    assert stored == [(b"acct-9", None, [], []), (None, b"{broken", ["h"], [None])]
    assert rows[0]["reason"].startswith("no idempotency key: invalid JSON")

    shown = run_cli("dead-letters", "show", str(rows[1]["id"]), dsn=dsn)
    assert "key              (null)" in shown.stdout
    assert "headers          h=(null)" in shown.stdout
    env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}
    ids = [str(r["id"]) for r in rows]
    done = run_cli("dead-letters", "replay", *ids, dsn=dsn, env=env)
    assert done.returncode == 0, done.stderr

    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await reader.start()
    try:
        tp = TopicPartition(topic, 0)
        reader.assign([tp])
        reader.seek(tp, 2)
        copies = [await reader.getone(), await reader.getone()]
    finally:
        await reader.stop()
    assert [(c.key, c.value, list(c.headers)) for c in copies] == [
        (b"acct-9", None, []),
        (None, b"{broken", [("h", None)]),
    ]


DB_PASSWORD = "db-pw-5c1f0e"  # noqa: S105 (made up: the test server trusts local logins)
LEDGER_PASSWORD = "ledger-pw-77a2"  # noqa: S105 (made up)


async def test_dead_letters_show_the_exception_the_handler_raised_without_credentials(
    dsn: str, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1)
    causes = {
        "p-amount": ValueError("amount must be an integer in minor units"),
        # The consumer's own password (in its DSN) and a URL's, quoted by a handler.
        "p-ledger": ConnectionError(
            f"ledger https://svc:{LEDGER_PASSWORD}@ledger.internal refused us; "
            f"our database password is {DB_PASSWORD}"
        ),
        "p-long": RuntimeError("response body: " + "x" * 2000),
    }

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        raise causes[msg.idempotency_key]

    with_password = f"{dsn}{'&' if '?' in dsn else '?'}password={DB_PASSWORD}"
    consumer = audit_support.consumer(
        handler, topic, bootstrap_servers, None, dsn=with_password, max_attempts=2
    )
    values = [orjson.dumps({"payment_id": key}) for key in causes]
    await helpers.produce(bootstrap_servers, topic, [(b"acct-7", v) for v in values])
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: _at_least(consumer.stats["dead_lettered"], 3), what="three dead letters"
        )

    listed = run_cli("dead-letters", "list", dsn=dsn)
    assert listed.returncode == 0, listed.stderr
    heading, *rows = listed.stdout.splitlines()[1:]
    assert heading.split()[-1] == "ERROR"
    amount, ledger, long = rows
    assert amount.endswith("  ValueError: amount must be an integer in minor units")
    assert ledger.endswith(
        "  ConnectionError: ledger https://svc:***@ledger.internal refused us; "
        "our database password is ***"
    )
    # The longest error is cut to its cell, the end marked.
    cut = "RuntimeError: response body: " + "x" * 68 + "..."
    assert long.endswith(f"  {cut}") and len(cut) == audit_ops.ERROR_CELL

    doc = json_out(run_cli("dead-letters", "list", "--format", "json", dsn=dsn))
    errors_ = [d["error"] for d in doc["dead_letters"]]
    assert errors_[:2] == [
        "ValueError: amount must be an integer in minor units",
        "ConnectionError: ledger https://svc:***@ledger.internal refused us; "
        "our database password is ***",
    ]
    # Stored bounded: dead-letters show and JSON have it whole, as stored.
    assert len(errors_[2]) == handler_.MAX_ERROR_LENGTH and errors_[2].endswith("x...")
    assert [d["reason"] for d in doc["dead_letters"]] == ["handler failed 2 times"] * 3

    first, second = (str(d["id"]) for d in doc["dead_letters"][:2])
    shown = run_cli("dead-letters", "show", first, dsn=dsn)
    assert "\nerror            ValueError: amount must be an integer in minor units\n" in (
        shown.stdout
    )
    whole = run_cli("dead-letters", "show", second, dsn=dsn)
    assert f"error            {errors_[1]}\n" in whole.stdout
    shown_json = json_out(run_cli("dead-letters", "show", second, "--format", "json", dsn=dsn))
    assert shown_json["dead_letters"][0]["error"] == errors_[1]
    for out in (listed, whole, shown_json):
        text = out if isinstance(out, dict) else out.stdout + out.stderr
        assert DB_PASSWORD not in str(text) and LEDGER_PASSWORD not in str(text)


async def _at_least(value: int, n: int) -> bool:
    return value >= n


def test_replay_without_kafka_is_refused_before_anything_changes(dsn: str) -> None:
    done = run_cli("dead-letters", "replay", "1", dsn=dsn)
    assert done.returncode == 2
    assert "KAFKA_BOOTSTRAP_SERVERS" in done.stderr


async def test_a_replayed_dead_letter_applies_once_however_often_it_is_replayed(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1)
    await pool.execute(support.EFFECTS)
    broken = {"p2"}  # until the "deploy" below, the handler fails on p2

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        if msg.idempotency_key in broken:
            raise RuntimeError(f"bug while applying {msg.idempotency_key}")
        await support.record_effect(msg, tx)

    consumer = audit_support.consumer(handler, topic, bootstrap_servers, pool, max_attempts=1)
    values = [orjson.dumps({"payment_id": p}) for p in ("p1", "p2", "p3")]
    await helpers.produce(bootstrap_servers, topic, [(b"acct-7", v) for v in values])
    env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}

    async def handled(n: int) -> bool:
        return consumer.stats["messages"] >= n

    async with support.running(consumer):
        await helpers.wait_for(lambda: handled(3), what="the first three messages")
        assert await support.effect_counts(pool) == (2, 2)
        dead = await pool.fetchval("SELECT id FROM dedup.dead_letters")

        broken.clear()  # the fix is deployed
        done = run_cli("dead-letters", "replay", str(dead), dsn=dsn, env=env)
        assert done.returncode == 0, done.stderr
        await helpers.wait_for(lambda: handled(4), what="the replayed copy")
        assert await support.effect_counts(pool) == (3, 3)

        # An operator replays it again: the claim path counts a duplicate.
        again = run_cli("dead-letters", "replay", str(dead), "--again", dsn=dsn, env=env)
        assert again.returncode == 0, again.stderr
        await helpers.wait_for(lambda: handled(5), what="the second replayed copy")

    assert await support.effect_counts(pool) == (3, 3)
    audit = json_out(run_cli("audit", "--key", "p2", "--format", "json", dsn=dsn))
    assert [(r["offset"], r["duplicates"]) for r in audit["processed"]] == [(3, 1)]
    assert [d["replayed_at"] is not None for d in audit["dead_letters"]] == [True]
    story = json_out(run_cli("events", "--key", "p2", "--format", "json", dsn=dsn))
    # (the suppressed copy is counted on the key's row, not written as an event)
    assert [e["kind"] for e in story["events"]] == ["dead_lettered", "replayed", "replayed"]


async def test_a_task_taken_over_after_a_crash_shows_both_tokens(dsn: str, pool: Any) -> None:
    await pool.execute(task_jobs.JOB_RUNS)
    crashing = await task_worker.start(
        "task", "run", "dedup_dev.task_jobs:hang", "--dsn", dsn,
        "--task", "month-end", "--key", "2026-11-30", "--ttl", "1", "--holder", "batch-a",
    )  # fmt: skip

    async def started() -> bool:
        return bool(await pool.fetchval("SELECT count(*) FROM job_runs"))

    await helpers.wait_for(started, within=20, what="batch-a's job to start")
    crashing.proc.send_signal(signal.SIGKILL)
    await crashing.finish()

    runner = dedup.TaskRunner(pool=pool, holder="batch-b")

    async def take_over() -> dedup.TaskOutcome | None:
        outcome = await runner.run("month-end", "2026-11-30", task_jobs.record, lease_ttl=1)
        return None if outcome.status == "skipped_running" else outcome

    assert (await helpers.wait_for(take_over, within=15, what="a takeover")).token == 2

    args = ("events", "--task", "month-end", "--business-key", "2026-11-30", "--format", "json")
    story = json_out(run_cli(*args, "--kind", "task_taken_over", dsn=dsn))["events"]
    assert len(story) == 1
    assert (story[0]["holder"], story[0]["token"]) == ("batch-b", 2)
    assert story[0]["detail"]["old_token"] == 1
    assert story[0]["detail"]["new_token"] == 2
    assert story[0]["detail"]["old_holder"] == "batch-a"
    everything = json_out(run_cli(*args, dsn=dsn))["events"]
    kinds = [e["kind"] for e in everything if e["kind"] != "task_skipped"]
    assert kinds[:2] == ["lease_acquired", "task_started"]
    assert kinds[-4:] == ["lease_acquired", "task_taken_over", "task_succeeded", "lease_released"]
