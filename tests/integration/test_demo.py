"""``make demo``'s program, small, on the test services: its summary, its commands, its manners.

The demo runs next to a database named ``dedup_demo`` and a ``demo-*`` topic
it did not create (the names its first version dropped and deleted); they
are untouched afterwards.  The commands it prints run as printed, from the
repository root, and its ``--drop`` command removes its own database and
topics and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import dedup_services.demo
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from dedup_dev import helpers
from dedup_dev.services import ROOT, Services

BIN_DIR = os.path.relpath(Path(sys.executable).parent, ROOT)
"""Where the demo's printed commands say the venv's programs are, from the repository root."""


def at_root(services: Services, *argv: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """``argv`` run at the repository root, with the two variables of the test services set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "VIRTUAL_ENV"))}
    env |= {"DEDUP_DSN": services.dsn, "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap_servers}
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def kafka_origin(services: Services) -> str:
    """How the demo should name whoever started Kafka at ``services.bootstrap_servers``."""
    local = ROOT / ".services" / "kafka"
    try:
        pid = int((local / "pid").read_text())
        port = (local / "port").read_text().strip()
        os.kill(pid, 0)
    except (OSError, ValueError):
        return "yours (KAFKA_BOOTSTRAP_SERVERS)"
    if services.bootstrap_servers.split(",")[0] == f"127.0.0.1:{port}":
        return f"started by compose/local/up (pid {pid})"
    return "yours (KAFKA_BOOTSTRAP_SERVERS)"


def demo(services: Services, *args: str) -> subprocess.CompletedProcess[str]:
    return at_root(services, sys.executable, "-m", "dedup_services.demo", *args, timeout=240)


def sh(command: str, services: Services) -> subprocess.CompletedProcess[str]:
    """``command`` as typed at the repository root, in a shell with the two variables set."""
    return at_root(services, "/bin/sh", "-c", command)


async def test_demo_touches_nothing_it_did_not_create_and_its_summary_adds_up(
    services: Services, tmp_path: Path
) -> None:
    others = await OthersData.create(services)
    run_id = None
    try:
        run = await asyncio.to_thread(
            demo, services, "--payments", "300", "--coupons", "100", "--notifications", "40",
            "--logs", str(tmp_path),
        )  # fmt: skip
        out = run.stdout
        named = re.search(r"^This run \((\w+)\):", out, re.MULTILINE)
        run_id = named[1] if named else None
        assert run.returncode == 0, out + run.stderr
        assert "RESULT: zero lost, zero doubled" in out
        assert (
            "statements generated                    1"
            "   (fired by the schedule, 2 schedulers: exit codes [0, 0])"
        ) in out
        assert "payments OK, coupons OK, notifications OK, statements OK" in out
        assert await others.untouched(), "the demo touched a database or topic it did not make"

        # Its summary adds up, and with what reconcile reports: rejections included.
        sent, handled, suppressed, dead, took_effect, declined = (
            _row(out, label)
            for label in (
                "messages sent",
                "keys handled once",
                "duplicates suppressed",
                "dead-lettered",
                "  took effect",
                "  declined by",
            )
        )
        assert sent == [h + s + d for h, s, d in zip(handled, suppressed, dead, strict=True)]
        assert handled[0] == 300 and took_effect[0] + declined[0] == 300
        assert declined[0] > 0, "the demo's payments include rejections for insufficient funds"
        applied = re.search(r"^ *source +applied payments +(\d+) +\S+$", out, re.MULTILINE)
        assert applied and int(applied[1]) == took_effect[0]
        assert "insufficient funds" in out

        # Who started the services: this checkout's compose/local/up when its Kafka
        # answers at that address (as in CI), else the environment's.
        assert f"Kafka at {services.bootstrap_servers}: {kafka_origin(services)}" in out

        # The commands it prints work as printed, from the repository root.
        commands = [line.strip() for line in out.splitlines() if line.startswith("  " + BIN_DIR)]
        assert len(commands) == 5, out
        look, drop = commands[:4], commands[4]
        for command in look:
            ran = await asyncio.to_thread(sh, command, services)
            assert ran.returncode == 0, f"{command}:\n{ran.stdout}{ran.stderr}"
        assert drop.split()[-1] == run_id
        database, topics = f"dedup_demo_{run_id}", _topics(run_id)
        assert await _databases(services, database) == [database]
        assert set(topics) <= await _topic_names(services)

        dropped = await asyncio.to_thread(sh, drop, services)
        assert dropped.returncode == 0, dropped.stdout + dropped.stderr
        assert await _databases(services, database) == []
        await _wait_gone(services, topics)
        run_id = None
        assert await others.untouched()
    finally:
        if run_id is not None:  # the test failed before the demo's own --drop
            await asyncio.to_thread(demo, services, "--drop", run_id)
        await others.remove()


async def test_demo_refuses_a_database_it_did_not_make(services: Services) -> None:
    others = await OthersData.create(services)
    try:
        before = await _topic_names(services)
        run = await asyncio.to_thread(demo, services, "--database", others.database)
        assert run.returncode == 2, run.stdout + run.stderr
        assert f"database {others.database} already exists and this run did not create it" in (
            run.stdout
        )
        assert await others.untouched()
        created = {t for t in await _topic_names(services) - before if t.startswith("dedup-demo-")}
        assert not created, f"a refused run left topics behind: {created}"
        # --drop drops only what a demo run marked as its own.
        refused = await asyncio.to_thread(demo, services, "--drop", "postgres")
        assert refused.returncode == 2
        assert "nothing is dropped" in refused.stdout
    finally:
        await others.remove()


def test_status_says_who_runs_the_services(services: Services, tmp_path: Path) -> None:
    status = ROOT / "compose" / "local" / "status"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "KAFKA_"))}
    base["DEDUP_SERVICES_DIR"] = str(tmp_path)  # compose/local/up started nothing here
    given = {"DEDUP_DSN": services.dsn, "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap_servers}

    def run(env: dict[str, str]) -> tuple[int, str]:
        done = subprocess.run(
            [status], env=env, capture_output=True, text=True, timeout=30, check=False
        )
        return done.returncode, done.stdout

    code, out = run(base | given)
    assert code == 0, out
    assert re.search(rf"^kafka +yours +{services.bootstrap_servers} +answers", out, re.M), out
    assert re.search(r"^postgres +yours +\S+ +answers \(DEDUP_DSN is set", out, re.M), out

    # The variables are gone from this shell, but compose/local/up wrote them to .services/env.
    (tmp_path / "env").write_text("".join(f"{k}={v}\n" for k, v in given.items()))
    code, out = run(base)
    assert code == 0, out
    assert re.search(r"^kafka +elsewhere .* answers; not started here", out, re.M), out

    code, out = run(base | given | {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert code == 1
    assert re.search(r"^kafka +yours +127\.0\.0\.1:1 +does not answer", out, re.M), out

    (tmp_path / "env").unlink()
    code, out = run(base)
    assert code == 1
    assert re.search(r"^kafka +stopped$", out, re.M), out


def _row(out: str, label: str) -> list[int]:
    (line,) = re.findall(rf"^{re.escape(label)}[a-z ]* +(\d.*)$", out, re.MULTILINE)
    return [int(n) for n in line.split()]


def _topics(run_id: str) -> list[str]:
    return [f"dedup-demo-{run_id}-{name}" for name in ("payments", "coupons", "notifications")]


async def _databases(services: Services, name: str) -> list[str]:
    conn = await asyncpg.connect(services.dsn)
    try:
        return [
            r[0]
            for r in await conn.fetch("SELECT datname FROM pg_database WHERE datname = $1", name)
        ]
    finally:
        await conn.close()


async def _topic_names(services: Services) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=services.bootstrap_servers)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


class OthersData:
    """A database named ``dedup_demo`` and a ``demo-*`` topic with a record: not the demo's."""

    database = "dedup_demo"

    def __init__(self, services: Services, topic: str, made_database: bool, oid: int) -> None:
        self.services = services
        self.topic = topic
        self.made_database = made_database
        self.oid = oid

    @classmethod
    async def create(cls, services: Services) -> OthersData:
        conn = await asyncpg.connect(services.dsn)
        try:
            try:
                await conn.execute(f'CREATE DATABASE "{cls.database}"')
                made = True
            except asyncpg.DuplicateDatabaseError:
                made = False  # someone's already: all the better, it must survive too
            oid = await conn.fetchval(
                "SELECT oid FROM pg_database WHERE datname = $1", cls.database
            )
        finally:
            await conn.close()
        topic = f"demo-payments-{uuid.uuid4().hex[:8]}"
        admin = AIOKafkaAdminClient(bootstrap_servers=services.bootstrap_servers)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1)])
        finally:
            await admin.close()
        await helpers.produce(services.bootstrap_servers, topic, [(None, b"someone's record")])
        return cls(services, topic, made, int(oid))

    async def untouched(self) -> bool:
        conn = await asyncpg.connect(self.services.dsn)
        try:
            oid = await conn.fetchval(
                "SELECT oid FROM pg_database WHERE datname = $1", self.database
            )
        finally:
            await conn.close()
        consumer = AIOKafkaConsumer(bootstrap_servers=self.services.bootstrap_servers)
        await consumer.start()
        try:
            partition = TopicPartition(self.topic, 0)
            ends = await consumer.end_offsets([partition])
        finally:
            await consumer.stop()
        return oid == self.oid and ends[partition] == 1

    async def remove(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.services.bootstrap_servers)
        await admin.start()
        try:
            await admin.delete_topics([self.topic])
        finally:
            await admin.close()
        if self.made_database:
            conn = await asyncpg.connect(self.services.dsn)
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            finally:
                await conn.close()


async def _wait_gone(services: Services, topics: list[str]) -> None:
    async def gone() -> bool:
        return not set(topics) & await _topic_names(services)

    await helpers.wait_for(gone, what=f"topics {topics} to be deleted")


def test_demo_names_compose_local_up_when_it_started_the_services(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, port in (("kafka", 9092), ("postgres", 5432)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pid").write_text(str(os.getpid()))  # a live process
        (tmp_path / name / "port").write_text(str(port))
    monkeypatch.setenv("DEDUP_SERVICES_DIR", str(tmp_path))
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092",
        "DEDUP_DSN": "postgresql://postgres@127.0.0.1:5432/postgres",
    }
    assert dedup_services.demo.origins(env, {"KAFKA_BOOTSTRAP_SERVERS", "DEDUP_DSN"}) == [
        f"Kafka at 127.0.0.1:9092: started by compose/local/up (pid {os.getpid()}); "
        "it keeps running, compose/local/down stops it.",
        f"Postgres at 127.0.0.1:5432: started by compose/local/up (pid {os.getpid()}); "
        "it keeps running, compose/local/down stops it.",
    ]
    env["DEDUP_DSN"] = "postgresql://app@db.example:5433/app"
    assert dedup_services.demo.origins(env, {"KAFKA_BOOTSTRAP_SERVERS"})[1] == (
        "Postgres at db.example:5433: yours (DEDUP_DSN); the demo leaves it running."
    )
