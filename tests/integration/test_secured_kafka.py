"""Secured Kafka end to end: the consumer, a bundled service and ``dedup dead-letters replay``
through a SASL/SCRAM-SHA-512 over TLS listener, and the errors a wrong password or an
untrusted certificate give (naming the listener and the setting, never the password).
Also the consumer's default ``client_id``, as Kafka's own group tool shows it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

import dedup
from dedup import _kafka_client as kafka_client
from dedup_dev import effects as support
from dedup_dev import helpers, kafka_tools
from dedup_dev import kafka as kafka_support
from dedup_dev import service_process as service_support
from dedup_dev.audit import add_dead_letter, json_out, run_cli_async
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT, SecuredKafka, Services


@pytest.fixture
async def secured_topics(secured_kafka: SecuredKafka) -> AsyncIterator[Topics]:
    """Topics made and deleted through the secured listener itself."""
    options = kafka_client.client_options(secured_kafka.settings())
    made = Topics(secured_kafka.bootstrap_servers, **options)
    yield made
    await made.delete_all()


async def produce(secured: SecuredKafka, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    options = kafka_client.client_options(secured.settings())
    await kafka_support.produce(secured.bootstrap_servers, topic, records, **options)


WRONG_PASSWORD = "not-the-password"  # noqa: S105 - a wrong one on purpose
BAD = {
    "wrong password": ({"sasl_plain_password": WRONG_PASSWORD}, "sasl_plain_password"),
    # No ssl_cafile: the system's CAs, which never signed the throwaway one.
    "untrusted certificate": ({"ssl_cafile": ""}, "ssl_cafile"),
}


def listener(secured: SecuredKafka) -> str:
    return f"the SASL_SSL listener at {secured.bootstrap_servers}"


async def apply_through(secured: SecuredKafka, topic: str, pool: Any, ids: list[int]) -> None:
    """Produce ``ids`` and have a consumer on the secured listener handle every record."""
    await pool.execute(support.EFFECTS)
    await produce(secured, topic, [(b"k", orjson.dumps({"id": i})) for i in ids])
    consumer = support.consumer(
        support.record_effect, topic, secured.bootstrap_servers, pool, **secured.settings()
    )
    async with support.running(consumer):
        await helpers.wait_for(lambda: support.handled(consumer, len(ids)), what="the records")


async def test_the_consumer_applies_through_sasl_ssl(
    secured_kafka: SecuredKafka, secured_topics: Topics, pool: Any
) -> None:
    topic = await secured_topics.create()
    await apply_through(secured_kafka, topic, pool, [1, 2, 1])
    assert await support.effect_counts(pool) == (2, 2)


@pytest.mark.parametrize("case", list(BAD))
async def test_the_consumer_names_the_listener_and_setting_it_was_refused_for(
    secured_kafka: SecuredKafka, pool: Any, case: str
) -> None:
    changes, setting = BAD[case]
    settings = {k: v for k, v in secured_kafka.settings(**changes).items() if v}
    consumer = support.consumer(
        support.record_effect, "t-any", secured_kafka.bootstrap_servers, pool, **settings
    )
    with pytest.raises(dedup.ConfigurationError) as refused:
        await consumer.run()
    message = str(refused.value)
    assert listener(secured_kafka) in message
    assert setting in message
    assert secured_kafka.password not in message


async def test_a_bundled_service_runs_through_sasl_ssl(
    secured_kafka: SecuredKafka, secured_topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await secured_topics.create()
    # Every setting as a variable (the password must not be a flag: it would show in ps).
    secured = secured_kafka.environ()
    bootstrap = secured.pop("KAFKA_BOOTSTRAP_SERVERS")
    env = service_support.environment(dsn, bootstrap, COUPONS_TOPIC=topic, **secured)
    request = {"request_id": "r1", "user_id": "u1", "campaign": "bf", "value": 5}
    async with service_support.child("run", "dedup_services.coupons", env=env) as service:
        await produce(secured_kafka, topic, [(b"u1", orjson.dumps(request))] * 2)

        async def applied() -> bool:
            if await pool.fetchval("SELECT to_regclass('coupons.requests')") is None:
                return False
            return bool(await pool.fetchval("SELECT count(*) = 1 FROM coupons.requests"))

        await helpers.wait_for(applied, what="the request applied once")
        assert await service.stop(signal.SIGTERM) == 0, await service.stderr()

    env["KAFKA_SASL_PLAIN_PASSWORD"] = WRONG_PASSWORD
    code, _, err = await service_support.run("run", "dedup_services.coupons", env=env)
    assert code != 0
    assert listener(secured_kafka) in err and "sasl_plain_password" in err, err
    assert WRONG_PASSWORD not in err


async def test_dead_letters_replay_through_sasl_ssl(
    secured_kafka: SecuredKafka, secured_topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await secured_topics.create()
    dead = await add_dead_letter(pool, topic=topic, key=b"acct-7", value=b'{"n": 1}')
    for changes, setting in BAD.values():
        env = secured_kafka.environ(**changes)
        refused = await run_cli_async("dead-letters", "replay", str(dead), dsn=dsn, env=env)
        assert refused.returncode != 0
        assert listener(secured_kafka) in refused.stderr, refused.stderr
        assert setting in refused.stderr
        assert secured_kafka.password not in refused.stderr + refused.stdout

    env = secured_kafka.environ()
    done = await run_cli_async(
        "dead-letters", "replay", str(dead), "--format", "json", dsn=dsn, env=env
    )
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in json_out(done)["replayed"]] == [dead]
    consumer = AIOKafkaConsumer(
        bootstrap_servers=secured_kafka.bootstrap_servers,
        enable_auto_commit=False,
        **kafka_client.client_options(secured_kafka.settings()),
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.seek_to_beginning(TopicPartition(topic, 0))
        record = await consumer.getone()
    finally:
        await consumer.stop()
    assert (record.key, record.value) == (b"acct-7", b'{"n": 1}')


async def test_offsets_show_skip_and_delete_group_through_sasl_ssl(
    secured_kafka: SecuredKafka, secured_topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await secured_topics.create()
    group = f"g-{topic}"
    await apply_through(secured_kafka, topic, pool, [0, 1, 2])
    await produce(secured_kafka, topic, [(b"k", orjson.dumps({"id": i})) for i in (3, 4)])

    env = secured_kafka.environ()
    show = ("offsets", "show", "--group", group, "--format", "json")
    done = await run_cli_async(*show, dsn=dsn, env=env)
    assert done.returncode == 0, done.stderr
    [row] = json_out(done)["partitions"]
    assert (row["next_offset"], row["end_offset"], row["lag"]) == (3, 5, 2)

    skip = (
        "offsets",
        "skip",
        "--group",
        group,
        "--topic",
        topic,
        "--partition",
        "0",
        "--to-offset",
        "5",
    )
    done = await run_cli_async(*skip, "--format", "json", dsn=dsn, env=env)
    assert done.returncode == 0, done.stderr
    [row] = json_out(done)["partitions"]
    assert (row["status"], row["new_offset"], row["kafka_committed"]) == ("skipped", 5, True)

    for changes, setting in BAD.values():
        refused = await run_cli_async(*show, dsn=dsn, env=secured_kafka.environ(**changes))
        assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
        assert listener(secured_kafka) in refused.stderr, refused.stderr
        assert setting in refused.stderr
        assert secured_kafka.password not in refused.stderr

    delete = ("offsets", "delete-group", "--group", group, "--format", "json")
    done = await run_cli_async(*delete, dsn=dsn, env=env)
    assert done.returncode == 0, done.stderr
    deleted = json_out(done)
    assert deleted["kafka_group"] == "deleted"
    assert [(r["status"], r["old_offset"]) for r in deleted["partitions"]] == [("deleted", 5)]


def demo(secured: SecuredKafka, dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m dedup_services.demo ARGS``, with only the secured listener's Kafka settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "KAFKA_"))}
    env |= {"DEDUP_DSN": dsn, **secured.environ()}
    argv = (sys.executable, "-m", "dedup_services.demo", *args)
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False
    )


async def test_the_demo_runs_through_sasl_ssl(
    secured_kafka: SecuredKafka, services: Services, tmp_path: Path
) -> None:
    # Its topics made, its records produced and its services run through the secured listener.
    sizes = ("--payments", "60", "--coupons", "20", "--notifications", "10")
    run = await asyncio.to_thread(
        demo, secured_kafka, services.dsn, *sizes, "--logs", str(tmp_path)
    )
    named = re.search(r"^This run \((\w+)\):", run.stdout, re.MULTILINE)
    try:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "RESULT: zero lost, zero doubled" in run.stdout
    finally:
        if named:
            dropped = await asyncio.to_thread(demo, secured_kafka, services.dsn, "--drop", named[1])
            assert dropped.returncode == 0, dropped.stdout + dropped.stderr
            assert f"dropped topic dedup-demo-{named[1]}-payments" in dropped.stdout


async def test_kafka_group_tool_shows_which_process_owns_a_partition(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    await pool.execute(support.EFFECTS)
    topic = await topics.create()
    await kafka_support.produce(bootstrap_servers, topic, [(b"k", b'{"id": 1}')])
    default = support.consumer(support.record_effect, topic, bootstrap_servers, pool)
    async with support.running(default):
        await helpers.wait_for(lambda: support.handled(default, 1), what="1 record")
        shown = await kafka_tools.run(
            "consumer-groups",
            *("--bootstrap-server", bootstrap_servers, "--describe", "--members"),
            *("--group", f"g-{topic}"),
        )
    # CLIENT-ID is the holder: host, pid and a short id.
    assert default.holder.startswith(f"{socket.gethostname()}:{os.getpid()}:")
    assert default.holder in shown.stdout, shown.stdout

    named = support.consumer(
        support.record_effect, topic, bootstrap_servers, pool, client_id="billing-7"
    )
    async with support.running(named):
        await helpers.wait_for(
            lambda: kafka_support.committed(bootstrap_servers, f"g-{topic}", topic),
            what="the group's commit",
        )
        shown = await kafka_tools.run(
            "consumer-groups",
            *("--bootstrap-server", bootstrap_servers, "--describe", "--members"),
            *("--group", f"g-{topic}"),
        )
    assert "billing-7" in shown.stdout, shown.stdout
