"""``make demo``: every bundled service under duplicates, a replay, a poison message and a crash.

    python -m consumers.demo [--payments N] [--coupons N] [--notifications N] [--database NAME]

On the Kafka and Postgres of ``KAFKA_BOOTSTRAP_SERVERS`` and ``DEDUP_DSN``
(else ``.services/env``), in a fresh database (``dedup_demo`` by default) and
fresh topics:

1. produces payments, coupon requests and notifications with duplicates, a
   replay of the first part of the payments topic, one poison message
   and one conflicting copy (the same payment id, another amount);
2. runs two instances of each consumer (and two outbox dispatchers and the
   receiver) as real ``dedup run`` processes, and kills one payments instance
   with SIGKILL half-way;
3. races two ``dedup task run`` statement runners for the same business date;
4. reconciles every service for the date, then prints a summary (lost and
   doubled counted from the business tables, not from the consumers' word)
   and the commands to look deeper.

The services started by ``compose/local/up`` keep running afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
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

import asyncpg
import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

DATE = "2026-11-30"
ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("payments", "coupons", "notifications")


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
    plan = Plan(accounts={f"acc-{i:02d}": rng.randint(20, 80) * 100 for i in range(40)})
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
    """The ``dedup run`` processes the demo starts; all stopped on exit."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.running: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, name: str, *args: str) -> asyncio.subprocess.Process:
        log = (self.logs / f"{name}.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dedup.cli",
            *args,
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=log,
        )
        self.running[name] = proc
        return proc

    def kill(self, name: str) -> None:
        self.running[name].send_signal(signal.SIGKILL)

    async def stop_all(self) -> None:
        for proc in self.running.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dedup.cli",
        *args,
        cwd=ROOT,
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


async def fresh_database(dsn: str, name: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return dsn.rsplit("/", 1)[0] + "/" + name


async def create_topics(bootstrap: str, run_id: str) -> dict[str, str]:
    topics = {name: f"demo-{name}-{run_id}" for name in SERVICES}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        old = [t for t in await admin.list_topics() if t.startswith("demo-")]
        if old:
            await admin.delete_topics(old)
        await admin.create_topics(
            [NewTopic(t, 4 if name == "payments" else 2, 1) for name, t in topics.items()]
        )
    finally:
        await admin.close()
    return topics


async def produce(bootstrap: str, topics: dict[str, str], plan: Plan, rng: random.Random) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=10)
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


def environment() -> dict[str, str]:
    """This process's variables, with the local services' addresses where none is set."""
    env = dict(os.environ)
    env_file = ROOT / ".services" / "env"
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            name, _, value = line.partition("=")
            if value and not env.get(name):
                env[name] = value
    if not env.get("DEDUP_DSN") or not env.get("KAFKA_BOOTSTRAP_SERVERS"):
        raise SystemExit("demo: set DEDUP_DSN and KAFKA_BOOTSTRAP_SERVERS, or run compose/local/up")
    return env


async def main(args: argparse.Namespace, env: dict[str, str]) -> int:
    started = time.monotonic()
    rng = random.Random(args.seed)  # noqa: S311 - the shape of a workload, not a secret
    bootstrap = env["KAFKA_BOOTSTRAP_SERVERS"]

    def step(text: str) -> None:
        say(f"[{time.monotonic() - started:5.1f}s] {text}")

    run_id = uuid.uuid4().hex[:6]
    dsn = await fresh_database(env["DEDUP_DSN"], args.database)
    env.update({"DEDUP_DSN": dsn, "DEDUP_LOG_LEVEL": "WARNING", "OTEL_SDK_DISABLED": "true"})
    step(f"fresh database {args.database}; migrating dedup and the services")
    migrations = await asyncio.gather(
        *(
            run_cli(env, "run", f"consumers.{name}", "--migrate-only")
            for name in (*SERVICES, "statements", "receiver")
        )
    )
    for code, out in migrations:
        if code != 0:
            raise SystemExit(f"demo: a migration failed:\n{out}")
    plan = make_plan(args, rng)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    await pool.executemany(
        "INSERT INTO payments.accounts (account, balance) VALUES ($1, $2)",
        list(plan.accounts.items()),
    )
    topics = await create_topics(bootstrap, run_id)
    for name, topic in topics.items():
        env[f"{name.upper()}_TOPIC"] = topic
        env[f"{name.upper()}_GROUP"] = f"demo-{name}-{run_id}"

    procs = Processes(env, Path(args.logs))
    port = free_port()
    try:
        step("starting the receiver, 2 instances of each consumer and 2 outbox dispatchers")
        await procs.start(
            "receiver", "run", "consumers.receiver", "--no-migrate", "--port", str(port)
        )
        for name in SERVICES:
            for i in (1, 2):
                await procs.start(
                    f"{name}-{i}",
                    "run",
                    f"consumers.{name}",
                    "--no-migrate",
                    "--holder",
                    f"demo-{name}-{i}",
                )
        url = f"http://127.0.0.1:{port}/notifications"
        for i in (1, 2):
            await procs.start(
                f"dispatcher-{i}",
                "run",
                "consumers.notifications",
                "--no-migrate",
                "--dispatcher",
                "--receiver-url",
                url,
                "--holder",
                f"dispatch-{i}",
            )

        step(
            f"producing {len(plan.payments)} payments, {len(plan.coupons)} coupon requests and "
            f"{len(plan.notifications)} notifications, with duplicates, a replay and a poison"
        )
        await produce(bootstrap, topics, plan, rng)
        step(f"sent {sum(plan.sent.values())} messages")

        async def decided(n: int) -> bool:
            return int(await pool.fetchval("SELECT count(*) FROM payments.payments")) >= n

        await wait_until(lambda: decided(len(plan.payments) // 3), "a third of the payments", 60)
        procs.kill("payments-1")
        step("killed payments-1 with SIGKILL mid-stream; payments-2 takes over its partitions")

        async def all_done() -> bool:
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

        await wait_until(all_done, "every message to be applied or dead-lettered", 90)
        step("every message applied, suppressed or dead-lettered")

        step(f"racing two statement runners for {DATE}")
        race = await asyncio.gather(
            *(
                run_cli(
                    env,
                    "task",
                    "run",
                    "consumers.statements:job",
                    "--task",
                    "statements",
                    "--key",
                    DATE,
                    "--holder",
                    f"cron-{host}",
                )
                for host in ("a", "b")
            )
        )
        codes = sorted(code for code, _ in race)
        step(f"runner exit codes {codes} (0 ran, 3 already done, 4 running elsewhere)")

        reconciled = {}
        for task in (*SERVICES, "statements"):
            code, out = await run_cli(env, "reconcile", "--task", task, "--date", DATE)
            reconciled[task] = (code, out)
    finally:
        await procs.stop_all()

    summary = await summarize(pool, plan, reconciled, codes)
    await pool.close()
    say("")
    say(summary.table)
    say("")
    say("Look deeper:")
    say(f"  dedup audit --dsn {dsn} --key pay-1 --namespace payments")
    say(f"  dedup events --dsn {dsn} --task statements --business-key {DATE}")
    say(f"  dedup dead-letters list --dsn {dsn}")
    say(f"  dedup reconcile --dsn {dsn} --task payments --date {DATE}")
    say(f"Logs of the services: {args.logs}/")
    say("Kafka and Postgres keep running; stop them with compose/local/down.")
    step("done")
    return 0 if summary.ok else 1


@dataclass
class Summary:
    table: str
    ok: bool


async def summarize(
    pool: Any, plan: Plan, reconciled: dict[str, tuple[int, str]], runner_codes: list[int]
) -> Summary:
    q = pool.fetchval
    applied = {
        name: int(await q("SELECT count(*) FROM dedup.processed WHERE namespace = $1", name))
        for name in SERVICES
    }
    suppressed = {
        name: int(
            await q(
                "SELECT coalesce(sum(duplicates), 0) FROM dedup.processed WHERE namespace = $1",
                name,
            )
        )
        for name in SERVICES
    }
    conflicts = {
        name: int(
            await q(
                "SELECT coalesce(sum(conflicts), 0) FROM dedup.processed WHERE namespace = $1", name
            )
        )
        for name in SERVICES
    }
    dead = {
        name: int(await q("SELECT count(*) FROM dedup.dead_letters WHERE namespace = $1", name))
        for name in SERVICES
    }
    stale = int(await q("SELECT count(*) FROM dedup.events WHERE kind = 'stale_rejected'"))
    # Lost and doubled from the business tables: what finance would count.
    decided = int(await q("SELECT count(DISTINCT payment_id) FROM payments.payments"))
    postings = int(await q("SELECT count(*) FROM payments.postings"))
    posted = int(await q("SELECT count(DISTINCT payment_id) FROM payments.postings"))
    wrong_balances = 0
    for account, opening in plan.accounts.items():
        spent = int(
            await q(
                "SELECT coalesce(sum(amount), 0) FROM payments.payments"
                " WHERE account = $1 AND status = 'applied'",
                account,
            )
        )
        balance = int(await q("SELECT balance FROM payments.accounts WHERE account = $1", account))
        wrong_balances += balance != opening - spent
    requests = int(await q("SELECT count(DISTINCT request_key) FROM coupons.requests"))
    pairs = {(c["user_id"], c["campaign"]) for c in plan.coupons}
    coupons_issued = int(await q("SELECT count(*) FROM coupons.coupons"))
    delivered = int(await q("SELECT count(*) FROM receiver.notifications"))
    # Deliveries the receiver acted on (201 delivered), against distinct notifications.
    deliveries = int(await q("SELECT count(*) FROM receiver.requests WHERE outcome = 'delivered'"))
    lost = {
        "payments": len(plan.payments) - decided,
        "coupons": len(plan.coupons) - requests,
        "notifications": len(plan.notifications) - delivered,
    }
    doubled = {
        "payments": (postings - posted) + wrong_balances,
        "coupons": max(coupons_issued - len(pairs), 0),
        "notifications": deliveries - delivered,
    }
    statements = int(
        await q("SELECT count(*) FROM dedup.events WHERE kind = 'task_started' AND key = $1", DATE)
    )
    rows = [
        ("messages sent", plan.sent),
        ("applied (distinct keys)", applied),
        ("duplicates suppressed", suppressed),
        ("conflicts", conflicts),
        ("dead-lettered", dead),
        ("lost", lost),
        ("doubled", doubled),
    ]
    width = 26
    lines = [f"{'':{width}}" + "".join(f"{n:>15}" for n in (*SERVICES, "total"))]
    for label, values in rows:
        total = sum(values.values())
        lines.append(
            f"{label:{width}}" + "".join(f"{values[n]:>15}" for n in SERVICES) + f"{total:>15}"
        )
    lines.append(f"{'stale writes refused':{width}}{stale:>15}")
    lines.append(
        f"{'statements generated':{width}}{statements:>15}   (runner exit codes {runner_codes})"
    )
    recon_ok = all(code == 0 for code, _ in reconciled.values())
    verdicts = ", ".join(
        f"{task} {'OK' if code == 0 else 'MISMATCH'}" for task, (code, _) in reconciled.items()
    )
    lines.append(f"{'reconciliation':{width}}{verdicts}")
    for task, (code, out) in reconciled.items():
        if code != 0:
            lines.append(f"  {task}: {out.strip()}")
    ok = (
        not any(lost.values())
        and not any(doubled.values())
        and statements == 1
        and recon_ok
        and dead["payments"] == 2  # the poison message and the conflicting copy
        and conflicts["payments"] == 1
    )
    lines.append("RESULT: " + ("zero lost, zero doubled" if ok else "FAILED"))
    return Summary("\n".join(lines), ok)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m consumers.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--payments", type=int, default=3000, help="distinct payments (default 3000)")
    p.add_argument("--coupons", type=int, default=1000, help="coupon requests (default 1000)")
    p.add_argument("--notifications", type=int, default=300, help="notifications (default 300)")
    p.add_argument("--database", default="dedup_demo", help="database to (re)create")
    p.add_argument("--logs", default=str(ROOT / ".services" / "demo-logs"), help="service logs")
    p.add_argument("--seed", type=int, default=2026)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    Path(arguments.logs).mkdir(parents=True, exist_ok=True)
    sys.exit(asyncio.run(main(arguments, environment())))
