"""``make demo``: every bundled service under duplicates, a replay, a poison message and a crash.

    python -m dedup_services.demo [--payments N] [--coupons N] [--notifications N] [--database NAME]
    python -m dedup_services.demo --drop RUN

On the Kafka and Postgres of ``KAFKA_BOOTSTRAP_SERVERS`` and ``DEDUP_DSN``
(else ``.services/env``, written by ``compose/local/up``; a secured cluster's
settings as ``KAFKA_SECURITY_PROTOCOL``, ``KAFKA_SASL_PLAIN_PASSWORD``, ...,
which the services it starts read too), in a database and
topics of its own, named after the run (``dedup_demo_<run>``,
``dedup-demo-<run>-payments``, ...):

1. produces payments, coupon requests and notifications with duplicates, a
   replay of the first part of the payments topic, one poison message
   and one conflicting copy (the same payment id, another amount);
2. runs two instances of each consumer (and two outbox dispatchers and the
   receiver) as real ``dedup run`` processes, and kills one payments instance
   with SIGKILL half-way;
3. adds the month-end statements schedule to the two ``dedup schedule run``
   schedulers it started with the consumers, from before the business date:
   the month-end period is past, and catch-up fires it once;
4. reconciles every service for the date, then prints a summary (lost and
   doubled counted from the business tables, not from the consumers' word)
   and the commands to look deeper.

It never touches what it did not create: a database or topic of the chosen
name that already exists stops it before anything is written, and nothing is
deleted by pattern.  Its database and topics stay for a look afterwards;
``--drop RUN`` removes them, and only them (the database carries a comment
naming the run and its topics).  Kafka and Postgres keep running, whoever
started them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, UnknownTopicOrPartitionError
from aiokafka.helpers import create_ssl_context

import dedup

DATE = "2026-11-30"
SERVICES = ("payments", "coupons", "notifications")
STATEMENTS_CRON = "0 22 L * *"
"""The statements schedule: 22:00 UTC on the last day of each month, business key that date."""
SCHEDULERS = ("scheduler-a", "scheduler-b")
MARK = "made by dedup's demo, run "
"""How the demo's own databases are marked (COMMENT ON DATABASE): ``--drop`` drops no other."""
EXIT_REFUSED = 2


def services_dir() -> Path:
    """compose/local's directory of addresses, pids and logs (run from the checkout's root)."""
    return Path(os.environ.get("DEDUP_SERVICES_DIR") or Path.cwd() / ".services")


def say(text: str) -> None:
    print(text, flush=True)


@dataclass
class Plan:
    """What the demo sends, and what the business tables must show afterwards."""

    payments: list[dict[str, Any]] = field(default_factory=list)
    coupons: list[dict[str, Any]] = field(default_factory=list)
    notifications: list[dict[str, Any]] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    accounts: dict[str, int] = field(default_factory=dict)


def make_plan(args: argparse.Namespace, rng: random.Random) -> Plan:
    # About half the payments find too little money left (a rejection, not an error).
    accounts = max(4, args.payments // 75)
    plan = Plan(accounts={f"acc-{i:02d}": rng.randint(20, 80) * 100 for i in range(accounts)})
    accounts = list(plan.accounts)
    plan.payments = [
        {
            "payment_id": f"pay-{i}",
            "account": rng.choice(accounts),
            "amount": rng.randint(1, 30) * 10,
            "date": DATE,
        }
        for i in range(args.payments)
    ]
    plan.coupons = [
        {
            "request_id": f"req-{i}",
            "user_id": f"u-{rng.randint(0, args.coupons // 2)}",  # some users ask twice
            "campaign": rng.choice(["black-friday", "cyber-monday"]),
            "value": 500,
            "date": DATE,
        }
        for i in range(args.coupons)
    ]
    plan.notifications = [
        {
            "notification_id": f"n-{i}",
            "recipient": f"u-{i}@example.com",
            "template": "payment-received",
            "data": {"n": i},
            "date": DATE,
        }
        for i in range(args.notifications)
    ]
    return plan


def with_copies(items: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """Every item, a tenth of them twice or three times (producer retries), shuffled a little."""
    out = []
    for item in items:
        out.append(item)
        if rng.random() < 0.1:
            out += [item] * rng.randint(1, 2)
    return out


# --------------------------------------------------------------- services --


class Processes:
    """The ``dedup`` processes the demo starts (services, schedulers); all stopped on exit."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.running: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, name: str, *args: str) -> asyncio.subprocess.Process:
        log = (self.logs / f"{name}.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dedup",
            *args,
            env=self.env,
            stdout=log,
            stderr=log,
        )
        self.running[name] = proc
        return proc

    def kill(self, name: str) -> None:
        self.running[name].send_signal(signal.SIGKILL)

    async def stop(self, *names: str) -> list[int]:
        """SIGTERM to each of ``names`` (every process if none), SIGKILL after 30 s; exit codes."""
        stopping = [self.running[n] for n in names] if names else list(self.running.values())
        for proc in stopping:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in stopping:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        return [int(proc.returncode or 0) for proc in stopping]


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dedup",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return int(proc.returncode or 0), out.decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(probe: Callable[[], Awaitable[bool]], what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not await probe():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: gave up after {within:.0f}s waiting for {what}")
        await asyncio.sleep(0.25)


# ------------------------------------------------------------------- demo --


class Refused(Exception):
    """Something of the name the demo would create exists already: it is not the demo's."""


@dataclass
class Made:
    """What this run created, and so may remove: its database and its topics."""

    run_id: str
    admin_dsn: str
    database: str
    topics: dict[str, str] = field(default_factory=dict)
    """The topic of each service, by service name."""
    created: list[str] = field(default_factory=list)
    """The topics created so far."""
    database_created: bool = False

    @property
    def dsn(self) -> str:
        return with_database(self.admin_dsn, self.database)

    def mark(self) -> str:
        return f"{MARK}{self.run_id}; topics: {', '.join(self.topics.values())}"


def with_database(dsn: str, database: str) -> str:
    url = urlsplit(dsn)
    return url._replace(path="/" + database).geturl()


def quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


async def create_database(made: Made) -> None:
    """CREATE DATABASE, never over one that exists: that one is someone's."""
    conn = await asyncpg.connect(made.admin_dsn)
    try:
        try:
            await conn.execute(f"CREATE DATABASE {quoted(made.database)}")
        except asyncpg.DuplicateDatabaseError:
            raise Refused(
                f"database {made.database} already exists and this run did not create it: "
                "the demo leaves it alone. Pass another --database, or none for a fresh "
                "dedup_demo_<run>."
            ) from None
        made.database_created = True
        await conn.execute(f"COMMENT ON DATABASE {quoted(made.database)} IS {literal(made.mark())}")
    finally:
        await conn.close()


def kafka_clients(env: dict[str, str]) -> dict[str, Any]:
    """The options of the demo's own Kafka clients: the address, and the security settings.

    The settings are the ``KAFKA_<NAME>`` variables of this process, read as the
    services it starts read them (``dedup.add_kafka_options``); the ``ssl_*file``
    ones made into the ``ssl_context`` aiokafka takes.
    """
    parser = argparse.ArgumentParser(add_help=False)
    dedup.add_kafka_options(parser)
    options: dict[str, Any] = dedup.kafka_options(parser.parse_args([]))
    files = {
        name.removeprefix("ssl_"): options.pop(name)
        for name in list(options)
        if name.startswith("ssl_")
    }
    if files or options.get("security_protocol") in ("SSL", "SASL_SSL"):
        options["ssl_context"] = create_ssl_context(**files)
    return {"bootstrap_servers": env["KAFKA_BOOTSTRAP_SERVERS"], **options}


async def create_topics(kafka: dict[str, Any], made: Made) -> None:
    """This run's topics, one by one; one that exists already is someone's: stop."""
    admin = AIOKafkaAdminClient(**kafka)
    try:
        await admin.start()
    except KafkaError as exc:
        await admin.close()
        protocol = kafka.get("security_protocol", "PLAINTEXT")
        raise SystemExit(
            f"demo: cannot reach Kafka at {kafka['bootstrap_servers']} ({protocol}): {exc}; "
            "check KAFKA_BOOTSTRAP_SERVERS and the KAFKA_* security settings "
            "(aiokafka's line above says what the listener refused)"
        ) from exc
    try:
        for name, topic in made.topics.items():
            try:
                await admin.create_topics([NewTopic(topic, 4 if name == "payments" else 2, 1)])
            except TopicAlreadyExistsError:
                raise Refused(
                    f"topic {topic} already exists and this run did not create it: "
                    "the demo leaves it alone"
                ) from None
            made.created.append(topic)
    finally:
        await admin.close()


async def drop(made: Made, kafka: dict[str, Any]) -> list[str]:
    """Remove this run's topics and database; what was removed, as lines to print."""
    removed = []
    if made.created:
        admin = AIOKafkaAdminClient(**kafka)
        await admin.start()
        try:
            for topic in made.created:
                try:
                    await admin.delete_topics([topic])
                except UnknownTopicOrPartitionError:
                    continue  # never created, or gone already
                removed.append(f"topic {topic}")
        finally:
            await admin.close()
    if made.database_created:
        conn = await asyncpg.connect(made.admin_dsn)
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {quoted(made.database)} WITH (FORCE)")
        finally:
            await conn.close()
        removed.append(f"database {made.database}")
    return removed


async def made_by_run(admin_dsn: str, run_id: str) -> Made:
    """What run ``run_id`` made, read from its database's comment; Refused if none says so."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        rows = await conn.fetch(
            "SELECT datname, shobj_description(oid, 'pg_database') AS mark FROM pg_database"
            " WHERE starts_with(shobj_description(oid, 'pg_database'), $1)",
            f"{MARK}{run_id};",
        )
    finally:
        await conn.close()
    if len(rows) != 1:
        raise Refused(
            f"no database is marked as made by the demo's run {run_id!r}: nothing is dropped"
        )
    made = Made(run_id, admin_dsn, rows[0]["datname"])
    made.database_created = True
    _, _, listed = rows[0]["mark"].partition("; topics: ")
    made.created = [t for t in listed.split(", ") if t]
    return made


async def produce(
    kafka: dict[str, Any], topics: dict[str, str], plan: Plan, rng: random.Random
) -> None:
    producer = AIOKafkaProducer(linger_ms=10, **kafka)
    await producer.start()
    try:
        sends = []
        payments = with_copies(plan.payments, rng)
        for p in payments:
            sends.append(
                await producer.send(topics["payments"], orjson.dumps(p), key=p["account"].encode())
            )
        # An operator replays the first fifth of the payments: every key already applied.
        replay = plan.payments[: len(plan.payments) // 5]
        for p in replay:
            sends.append(
                await producer.send(topics["payments"], orjson.dumps(p), key=p["account"].encode())
            )
        # The same payment id with another amount: a conflict, never applied silently.
        altered = {**plan.payments[7], "amount": plan.payments[7]["amount"] + 1}
        sends.append(
            await producer.send(
                topics["payments"], orjson.dumps(altered), key=altered["account"].encode()
            )
        )
        poison = b'{"payment_id": "pay-poison", "account": '  # cut off mid-way
        sends.append(await producer.send(topics["payments"], poison, key=b"acc-00"))
        coupons = with_copies(plan.coupons, rng)
        for c in coupons:
            sends.append(await producer.send(topics["coupons"], orjson.dumps(c)))
        notes = with_copies(plan.notifications, rng)
        for n in notes:
            sends.append(await producer.send(topics["notifications"], orjson.dumps(n)))
        await asyncio.gather(*sends)
    finally:
        await producer.stop()
    plan.sent = {
        "payments": len(payments) + len(replay) + 2,
        "coupons": len(coupons),
        "notifications": len(notes),
    }


def environment() -> tuple[dict[str, str], set[str]]:
    """This process's variables, with the local services' addresses where none is set.

    Also which of the two addresses came from ``.services/env`` rather than
    from this process's environment.
    """
    env = dict(os.environ)
    from_file = set()
    env_file = services_dir() / "env"
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            name, _, value = line.partition("=")
            if value and not env.get(name):
                env[name] = value
                from_file.add(name)
    if not env.get("DEDUP_DSN") or not env.get("KAFKA_BOOTSTRAP_SERVERS"):
        raise SystemExit("demo: set DEDUP_DSN and KAFKA_BOOTSTRAP_SERVERS, or run compose/local/up")
    return env, from_file


def _local_service(name: str) -> tuple[int, str] | None:
    """The pid and address of the service compose/local/up started, if it runs."""
    folder = services_dir() / name
    try:
        pid = int((folder / "pid").read_text())
        port = (folder / "port").read_text().strip()
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, under another user (Postgres runs as postgres)
    return pid, f"127.0.0.1:{port}"


def origins(env: dict[str, str], from_file: set[str]) -> list[str]:
    """Who started Kafka and Postgres, one line each: the demo started neither."""
    lines = []
    for label, name, variable, address in (
        ("Kafka", "kafka", "KAFKA_BOOTSTRAP_SERVERS", env["KAFKA_BOOTSTRAP_SERVERS"].split(",")[0]),
        ("Postgres", "postgres", "DEDUP_DSN", _host_port(env["DEDUP_DSN"])),
    ):
        local = _local_service(name)
        if local is not None and local[1] == address:
            lines.append(
                f"{label} at {address}: started by compose/local/up (pid {local[0]}); "
                "it keeps running, compose/local/down stops it."
            )
        else:
            source = (
                f"{variable} in {services_dir() / 'env'}" if variable in from_file else variable
            )
            lines.append(f"{label} at {address}: yours ({source}); the demo leaves it running.")
    return lines


def _host_port(dsn: str) -> str:
    url = urlsplit(dsn)
    return f"{url.hostname or '127.0.0.1'}:{url.port or 5432}"


def log_folder(path: str | Path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def relative(path: Path) -> str:
    """``path`` as typed from the current directory (absolute when outside it)."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def command(program: str) -> str:
    """How to type ``program`` of this venv from the current directory."""
    return relative(Path(sys.executable).parent / program)


async def main(args: argparse.Namespace, env: dict[str, str], from_file: set[str]) -> int:
    if args.drop:
        return await drop_run(args.drop, env)
    run_id = uuid.uuid4().hex[:6]
    made = Made(
        run_id,
        env["DEDUP_DSN"],
        args.database or f"dedup_demo_{run_id}",
        {name: f"dedup-demo-{run_id}-{name}" for name in SERVICES},
    )
    logs = log_folder(args.logs or services_dir() / "demo-logs" / run_id)
    for line in origins(env, from_file):
        say(line)
    try:
        await create_database(made)
        await create_topics(kafka_clients(env), made)
    except Refused as exc:
        await drop(made, kafka_clients(env))
        say(f"demo: {exc}")
        return EXIT_REFUSED
    except BaseException:
        await drop(made, kafka_clients(env))
        raise
    say(f"This run ({run_id}): database {made.database}, topics {', '.join(made.topics.values())}")
    ok = False
    try:
        ok = await demo(args, env, made, logs)
    finally:
        say(f"Logs of the services: {relative(logs)}/")
        say(
            f"Database {made.database} and the topics of run {run_id} stay for a look"
            f"{'' if ok else ' at what went wrong'}; remove them, and only them, with:"
        )
        say(f"  {command('python')} -m dedup_services.demo --drop {run_id}")
        for line in origins(env, from_file):
            say(line)
    return 0 if ok else 1


async def drop_run(run_id: str, env: dict[str, str]) -> int:
    try:
        made = await made_by_run(env["DEDUP_DSN"], run_id)
    except Refused as exc:
        say(f"demo: {exc}")
        return EXIT_REFUSED
    for removed in await drop(made, kafka_clients(env)):
        say(f"dropped {removed}")
    return 0


@dataclass
class Timeline:
    """The demo's progress lines, each stamped with the seconds since it started."""

    started: float = field(default_factory=time.monotonic)

    def step(self, text: str) -> None:
        say(f"[{time.monotonic() - self.started:5.1f}s] {text}")


async def demo(args: argparse.Namespace, env: dict[str, str], made: Made, logs: Path) -> bool:
    """The demo proper, in the database and topics of ``made``; True when the summary is."""
    timeline = Timeline()
    rng = random.Random(args.seed)  # noqa: S311 - the shape of a workload, not a secret
    env = services_env(env, made)
    timeline.step(f"migrating dedup and the services in {made.database}")
    await migrate(env)
    plan = make_plan(args, rng)
    pool = await asyncpg.create_pool(made.dsn, min_size=1, max_size=2)
    await seed_accounts(pool, plan)

    procs = Processes(env, logs)
    try:
        timeline.step(
            "starting the receiver, 2 instances of each consumer, 2 outbox dispatchers"
            " and 2 schedulers"
        )
        await start_services(procs)
        timeline.step(
            f"producing {len(plan.payments)} payments, {len(plan.coupons)} coupon requests and "
            f"{len(plan.notifications)} notifications, with duplicates, a replay and a poison"
        )
        await produce(kafka_clients(env), made.topics, plan, rng)
        timeline.step(f"sent {sum(plan.sent.values())} messages")
        await wait_until(
            lambda: payments_decided(pool, len(plan.payments) // 3), "a third of the payments", 60
        )
        procs.kill("payments-1")
        timeline.step(
            "killed payments-1 with SIGKILL mid-stream; payments-2 takes over its partitions"
        )
        await wait_until(
            lambda: all_settled(pool, plan), "every message to be applied or dead-lettered", 90
        )
        timeline.step("every message applied, suppressed or dead-lettered")
        timeline.step(
            f"adding the statements schedule ({STATEMENTS_CRON}, from {DATE}):"
            " its month-end period is past, catch-up fires it once"
        )
        await schedule_statements(env, pool)
        await wait_until(lambda: statements_done(pool), f"the statements of {DATE}", 60)
        scheduler_codes = await procs.stop(*SCHEDULERS)
        timeline.step(
            f"statements of {DATE} done; schedulers stopped (exit codes {scheduler_codes})"
        )
        reconciled = await reconcile(env)
    finally:
        await procs.stop()

    summary = await summarize(pool, plan, reconciled, scheduler_codes)
    await pool.close()
    say("")
    say(summary.table)
    say("")
    for line in look_deeper(made.dsn):
        say(line)
    timeline.step("done")
    return summary.ok


def services_env(env: dict[str, str], made: Made) -> dict[str, str]:
    """``env`` for the services of this run: its database, its topics, its consumer groups."""
    env = {**env, "DEDUP_DSN": made.dsn, "DEDUP_LOG_LEVEL": "WARNING", "OTEL_SDK_DISABLED": "true"}
    for name, topic in made.topics.items():
        env[f"{name.upper()}_TOPIC"] = topic
        env[f"{name.upper()}_GROUP"] = f"dedup-demo-{made.run_id}-{name}"
    return env


async def migrate(env: dict[str, str]) -> None:
    """dedup's tables and every service's, all services at once."""
    migrations = await asyncio.gather(
        *(
            run_cli(env, "run", f"dedup_services.{name}", "--migrate-only")
            for name in (*SERVICES, "statements", "receiver")
        )
    )
    for code, out in migrations:
        if code != 0:
            raise SystemExit(f"demo: a migration failed:\n{out}")


async def seed_accounts(pool: asyncpg.Pool, plan: Plan) -> None:
    await pool.executemany(
        "INSERT INTO payments.accounts (account, balance) VALUES ($1, $2)",
        list(plan.accounts.items()),
    )


async def start_services(procs: Processes) -> None:
    """The receiver, two instances of each consumer, two outbox dispatchers, two schedulers."""
    port = free_port()
    await procs.start(
        "receiver", "run", "dedup_services.receiver", "--no-migrate", "--port", str(port)
    )
    for name in SERVICES:
        for i in (1, 2):
            await procs.start(
                f"{name}-{i}",
                "run",
                f"dedup_services.{name}",
                "--no-migrate",
                "--holder",
                f"demo-{name}-{i}",
            )
    url = f"http://127.0.0.1:{port}/notifications"
    for i in (1, 2):
        await procs.start(
            f"dispatcher-{i}",
            "run",
            "dedup_services.notifications",
            "--no-migrate",
            "--dispatcher",
            "--receiver-url",
            url,
            "--holder",
            f"dispatch-{i}",
        )
    for name in SCHEDULERS:  # nothing to fire until the statements schedule is added
        await procs.start(
            name, "schedule", "run", "--holder", f"demo-{name}", "--poll-interval", "1"
        )


async def payments_decided(pool: asyncpg.Pool, at_least: int) -> bool:
    return int(await pool.fetchval("SELECT count(*) FROM payments.payments")) >= at_least


async def all_settled(pool: asyncpg.Pool, plan: Plan) -> bool:
    """Every message of ``plan`` applied, and the two bad payments dead-lettered."""
    row = await pool.fetchrow(
        """SELECT (SELECT count(*) FROM payments.payments) AS payments,
                  (SELECT count(*) FROM coupons.requests) AS coupons,
                  (SELECT count(*) FROM receiver.notifications) AS delivered,
                  (SELECT count(*) FROM dedup.dead_letters) AS dead"""
    )
    return bool(
        row["payments"] >= len(plan.payments)
        and row["coupons"] >= len(plan.coupons)
        and row["delivered"] >= len(plan.notifications)
        and row["dead"] >= 2
    )


async def schedule_statements(env: dict[str, str], pool: asyncpg.Pool) -> None:
    """The statements schedule, its periods from DATE on.

    DATE's period is in the past: missed, as if every scheduler had been down
    at month end.  The catch-up window reaches back to it, so catch-up ``all``
    fires it (and any month end since, which finds no payments).
    """
    today = await pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    window = (today - dt.date.fromisoformat(DATE)).days + 1
    code, out = await run_cli(
        env, "schedule", "add", "statements", "dedup_services.statements:job",
        "--task", "statements", "--cron", STATEMENTS_CRON, "--start", f"{DATE}T00:00:00+00:00",
        "--catch-up", "all", "--window", f"{window}d",
    )  # fmt: skip
    if code != 0:
        raise SystemExit(f"demo: dedup schedule add failed:\n{out}")


async def statements_done(pool: asyncpg.Pool) -> bool:
    state = await pool.fetchval(
        "SELECT state FROM dedup.tasks WHERE task = 'statements' AND business_key = $1", DATE
    )
    return bool(state == "succeeded")


async def reconcile(env: dict[str, str]) -> dict[str, tuple[int, str]]:
    """``dedup reconcile`` of each task for DATE: its exit code and output, by task."""
    reconciled = {}
    for task in (*SERVICES, "statements"):
        reconciled[task] = await run_cli(env, "reconcile", "--task", task, "--date", DATE)
    return reconciled


def look_deeper(dsn: str) -> list[str]:
    """The commands to look into the run afterwards, as lines to print."""
    dedup_cli = command("dedup")
    return [
        "Look deeper (from this directory; or `. .venv/bin/activate` first, then just `dedup`):",
        f"  {dedup_cli} audit --dsn {dsn} --key pay-1 --namespace payments",
        f"  {dedup_cli} events --dsn {dsn} --task statements --business-key {DATE}",
        f"  {dedup_cli} dead-letters list --dsn {dsn}",
        f"  {dedup_cli} reconcile --dsn {dsn} --task payments --date {DATE}",
    ]


# ---------------------------------------------------------------- summary --

WIDTH = 26
"""The width of the summary table's first column."""


@dataclass
class Summary:
    table: str
    ok: bool


@dataclass
class Figures:
    """What the run left behind, counted in Postgres; each by service name unless said."""

    applied: dict[str, int]
    """Keys handled once (rows of dedup.processed)."""
    took_effect: dict[str, int]
    """Of those, the ones that did something: a payment deducted, a coupon issued, a delivery."""
    declined: dict[str, int]
    """Of those, the ones a business rule turned down."""
    suppressed: dict[str, int]
    """Duplicates dedup recognised and did not run."""
    conflicts: dict[str, int]
    """Copies of a key with another payload."""
    dead: dict[str, int]
    """Dead letters."""
    lost: dict[str, int]
    """Items of the plan that left no row in the business tables."""
    doubled: dict[str, int]
    """Effects beyond one per item: extra postings, wrong balances, extra coupons or deliveries."""
    rejections: list[tuple[int, str]]
    """Why payments were rejected: how many, for what reason; the most frequent first."""
    stale: int
    """Writes refused for a stale fencing token, all services together."""
    statements: int
    """Statement runs started for DATE."""


async def summarize(
    pool: asyncpg.Pool,
    plan: Plan,
    reconciled: dict[str, tuple[int, str]],
    scheduler_codes: list[int],
) -> Summary:
    figures = await count_figures(pool, plan)
    ok = (
        adds_up(figures)
        and all(code == 0 for code, _ in reconciled.values())
        and all(code == 0 for code in scheduler_codes)
    )
    return Summary("\n".join(table(figures, plan, reconciled, scheduler_codes, ok)), ok)


async def count_figures(pool: asyncpg.Pool, plan: Plan) -> Figures:
    q = pool.fetchval

    async def per_service(query: str) -> dict[str, int]:
        return {name: int(await q(query, name)) for name in SERVICES}

    delivered = int(await q("SELECT count(*) FROM receiver.notifications"))
    lost, doubled = await lost_and_doubled(pool, plan, delivered)
    reasons = await pool.fetch(
        "SELECT split_part(reason, ':', 1) AS reason, count(*) FROM payments.payments"
        " WHERE status = 'rejected' GROUP BY 1 ORDER BY 2 DESC, 1"
    )
    return Figures(
        applied=await per_service("SELECT count(*) FROM dedup.processed WHERE namespace = $1"),
        # What the handled keys did: the figures `dedup reconcile` counts from.
        took_effect={
            "payments": int(
                await q("SELECT count(*) FROM payments.payments WHERE status = 'applied'")
            ),
            "coupons": int(
                await q("SELECT count(*) FROM coupons.requests WHERE outcome = 'issued'")
            ),
            "notifications": delivered,
        },
        declined={
            "payments": int(
                await q("SELECT count(*) FROM payments.payments WHERE status = 'rejected'")
            ),
            "coupons": int(
                await q("SELECT count(*) FROM coupons.requests WHERE outcome = 'already_issued'")
            ),
            "notifications": 0,
        },
        suppressed=await per_service(
            "SELECT coalesce(sum(duplicates), 0) FROM dedup.processed WHERE namespace = $1"
        ),
        conflicts=await per_service(
            "SELECT coalesce(sum(conflicts), 0) FROM dedup.processed WHERE namespace = $1"
        ),
        dead=await per_service("SELECT count(*) FROM dedup.dead_letters WHERE namespace = $1"),
        lost=lost,
        doubled=doubled,
        rejections=[(r["count"], r["reason"]) for r in reasons],
        stale=int(await q("SELECT count(*) FROM dedup.events WHERE kind = 'stale_rejected'")),
        statements=int(
            await q(
                "SELECT count(*) FROM dedup.events WHERE kind = 'task_started' AND key = $1", DATE
            )
        ),
    )


async def lost_and_doubled(
    pool: asyncpg.Pool, plan: Plan, delivered: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Lost and doubled from the business tables: what finance would count."""
    q = pool.fetchval
    decided = int(await q("SELECT count(DISTINCT payment_id) FROM payments.payments"))
    postings = int(await q("SELECT count(*) FROM payments.postings"))
    posted = int(await q("SELECT count(DISTINCT payment_id) FROM payments.postings"))
    requests = int(await q("SELECT count(DISTINCT request_key) FROM coupons.requests"))
    pairs = {(c["user_id"], c["campaign"]) for c in plan.coupons}
    coupons_issued = int(await q("SELECT count(*) FROM coupons.coupons"))
    # Deliveries the receiver acted on (201 delivered), against distinct notifications.
    deliveries = int(await q("SELECT count(*) FROM receiver.requests WHERE outcome = 'delivered'"))
    lost = {
        "payments": len(plan.payments) - decided,
        "coupons": len(plan.coupons) - requests,
        "notifications": len(plan.notifications) - delivered,
    }
    doubled = {
        "payments": (postings - posted) + await wrong_balances(pool, plan),
        "coupons": max(coupons_issued - len(pairs), 0),
        "notifications": deliveries - delivered,
    }
    return lost, doubled


async def wrong_balances(pool: asyncpg.Pool, plan: Plan) -> int:
    """Accounts whose balance is not the opening one less the payments applied to it."""
    q = pool.fetchval
    wrong = 0
    for account, opening in plan.accounts.items():
        spent = int(
            await q(
                "SELECT coalesce(sum(amount), 0) FROM payments.payments"
                " WHERE account = $1 AND status = 'applied'",
                account,
            )
        )
        balance = int(await q("SELECT balance FROM payments.accounts WHERE account = $1", account))
        wrong += balance != opening - spent
    return wrong


def adds_up(figures: Figures) -> bool:
    """Every handled key accounted for, nothing lost or doubled, each bad payment caught."""
    return (
        all(figures.took_effect[n] + figures.declined[n] == figures.applied[n] for n in SERVICES)
        and not any(figures.lost.values())
        and not any(figures.doubled.values())
        and figures.statements == 1
        and figures.dead["payments"] == 2  # the poison message and the conflicting copy
        and figures.conflicts["payments"] == 1
    )


def table(
    figures: Figures,
    plan: Plan,
    reconciled: dict[str, tuple[int, str]],
    scheduler_codes: list[int],
    ok: bool,
) -> list[str]:
    """The summary as printed: the table by service, the reconciliations, the verdict."""
    rows = [
        ("messages sent", plan.sent),
        ("keys handled once", figures.applied),
        ("  took effect", figures.took_effect),
        ("  declined by a rule", figures.declined),
        ("duplicates suppressed", figures.suppressed),
        ("conflicts", figures.conflicts),
        ("dead-lettered", figures.dead),
        ("lost", figures.lost),
        ("doubled", figures.doubled),
    ]
    lines = [f"{'':{WIDTH}}" + "".join(f"{n:>15}" for n in (*SERVICES, "total"))]
    for label, values in rows:
        total = sum(values.values())
        lines.append(
            f"{label:{WIDTH}}" + "".join(f"{values[n]:>15}" for n in SERVICES) + f"{total:>15}"
        )
    rejected = ", ".join(f"{count} {reason}" for count, reason in figures.rejections) or "none"
    lines += [
        "  sent = handled once + duplicates suppressed + dead-lettered (a conflicting copy is",
        "    dead-lettered: it counts as a conflict too)",
        "  took effect: payments deducted, coupons issued, notifications delivered",
        f"  declined: payments rejected ({rejected}); coupon requests for a campaign whose",
        "    coupon the user already had (they get that one)",
    ]
    lines.append(f"{'stale writes refused':{WIDTH}}{figures.stale:>15}")
    lines.append(
        f"{'statements generated':{WIDTH}}{figures.statements:>15}"
        f"   (fired by the schedule, 2 schedulers: exit codes {scheduler_codes})"
    )
    verdicts = ", ".join(
        f"{task} {'OK' if code == 0 else 'MISMATCH'}" for task, (code, _) in reconciled.items()
    )
    lines.append(f"{'reconciliation':{WIDTH}}{verdicts}")
    lines.append(f"  as `dedup reconcile --task TASK --date {DATE}` reports it:")
    for _, out in reconciled.values():
        lines += [f"  {line}" for line in out.strip().splitlines()]
    lines.append("RESULT: " + ("zero lost, zero doubled" if ok else "FAILED"))
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dedup_services.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--payments", type=int, default=3000, help="distinct payments (default 3000)")
    p.add_argument("--coupons", type=int, default=1000, help="coupon requests (default 1000)")
    p.add_argument("--notifications", type=int, default=300, help="notifications (default 300)")
    p.add_argument(
        "--database",
        help="the database to create (default: dedup_demo_<run>); one that exists is refused",
    )
    p.add_argument("--logs", help="service logs (default: .services/demo-logs/<run>)")
    p.add_argument(
        "--drop",
        metavar="RUN",
        help="remove the database and topics run RUN created (its first line names it), and exit",
    )
    p.add_argument("--seed", type=int, default=2026)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(), *environment())))
