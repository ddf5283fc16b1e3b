"""The outbox pipeline under relay faults: payments -> tx.publish -> relay -> a ledger.

A ``payments`` consumer (in this process) writes an effect per payment and
publishes ``payment-applied`` with ``tx.publish``; three relays
(:mod:`tests.chaos.relay_child`, each its own process) compete for the relay's
lease; a downstream consumer keyed by ``dedup-key`` writes a ledger row per
record.  While payments flow, the relay holding the lease is SIGKILLed three
times right after the broker took a batch and before it marked the rows sent
(a new relay is started for each), and once SIGSTOPped with a batch read until
another relay took the lease over and published (a zombie), then SIGCONTed.

The oracle: every payment has exactly one effect, one outbox row (sent), one
ledger row, and in exactly-once mode exactly one record on the output topic
read ``read_committed``; no ``published`` batch carries the zombie's token
after the takeover.  ``make test`` runs one seed in exactly-once mode;
``make chaos`` three seeds of each mode, and (test_relay_cluster.py) the same
pipeline on the three-broker cluster with the output partition's leader killed.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from typing import Any

import orjson
import pytest

import dedup
from dedup import _relay as relaying
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.children import Child
from tests.chaos import driver, kafka_cluster, scenarios

pytestmark = pytest.mark.chaos

PAYMENTS = {"tiny": 200, "short": 400, "full": 3000}
SEEDS = {"tiny": [1], "short": [1], "full": [1, 2, 3]}
MODES = {"tiny": ["exactly_once"], "short": ["exactly_once"], "full": list(relaying.MODES)}
KILLS = 3
LEASE_TTL = 2.0
TABLES = """
CREATE TABLE IF NOT EXISTS chaos_relay_effects (payment_id text, token bigint);
CREATE TABLE IF NOT EXISTS chaos_relay_ledger (dedup_key text, payment_id text);
"""
"""No unique keys, on purpose: a double shows up as a second row."""


async def apply_payment(msg: dedup.Message, tx: dedup.Tx) -> None:
    p = msg.json()
    await tx.conn.execute(
        "INSERT INTO chaos_relay_effects VALUES ($1, $2)", p["payment_id"], tx.token
    )
    await tx.publish(OUTPUT[0], {"payment_id": p["payment_id"]}, key=p["payment_id"])


async def record_in_ledger(msg: dedup.Message, tx: dedup.Tx) -> None:
    await tx.conn.execute(
        "INSERT INTO chaos_relay_ledger VALUES ($1, $2)", msg.idempotency_key,
        msg.json()["payment_id"],
    )  # fmt: skip


OUTPUT: list[str] = [""]
"""The run's output topic, for the handler."""


class Pipeline:
    """One run: the topics, the in-process consumers, the relay children, the story."""

    def __init__(
        self,
        ctx: driver.RunContext,
        mode: str,
        seed: int,
        cluster: kafka_cluster.KafkaCluster | None = None,
    ) -> None:
        self.ctx = ctx
        self.mode = mode
        self.cluster = cluster
        self.bootstrap = cluster.bootstrap_servers if cluster else ctx.services.bootstrap_servers
        self.rng = random.Random(seed)
        self.name = f"chaos-{seed}-{time.monotonic_ns()}"
        self.topics = kafka_support.Topics(self.bootstrap)
        self.relays: list[Child] = []
        self.story: list[str] = []
        self.started = time.monotonic()
        self.pool: Any = None
        self.zombie: tuple[Child, int] | None = None

    def note(self, text: str) -> None:
        self.story.append(f"{time.monotonic() - self.started:7.2f}s {text}")

    async def start_relay(self) -> Child:
        holder = f"relay-{len(self.relays) + 1}"
        child = await Child.start(
            "tests.chaos.relay_child",
            [
                "--dsn", self.ctx.dsn, "--bootstrap-servers", self.bootstrap,
                "--name", self.name, "--holder", holder, "--mode", self.mode,
                "--ttl", str(LEASE_TTL),
            ],
            name=holder,
            logs=self.ctx.logs,
        )  # fmt: skip
        await child.expect("READY", within=60)
        self.relays.append(child)
        return child

    async def holder(self) -> tuple[Child, int]:
        """The relay child holding the lease now, and its token."""

        async def held() -> Any:
            return await self.pool.fetchrow(
                "SELECT holder, token FROM dedup.leases WHERE resource = $1 AND expires_at > now()",
                f"relay:{self.name}",
            )

        row = await helpers.wait_for(held, within=60, what="a relay to hold the lease")
        [child] = [c for c in self.relays if c.name == row["holder"]]
        return child, row["token"]

    async def sent(self) -> int:
        return int(
            await self.pool.fetchval("SELECT count(*) FROM dedup.outbox WHERE status = 'sent'")
        )

    async def published_after(self, token: int) -> bool:
        return bool(
            await self.pool.fetchval(
                "SELECT count(*) > 0 FROM dedup.events WHERE kind = 'published' AND token > $1"
                " AND key = $2",
                token,
                self.name,
            )
        )

    async def strike(self, fault: str) -> None:
        before = await self.sent()
        await helpers.wait_for(
            lambda: self._more_sent(before), within=60, what=f"records published before {fault}"
        )
        if fault == "kill_output_leader":
            await self.kill_output_leader()
            return
        child, token = await self.holder()
        child.struck = True
        child.send(fault)
        await child.expect(f"STRUCK {fault}", within=60)
        if fault == "kill_after_send":
            await child.wait()
            self.note(f"{child.name} (token {token}) SIGKILLed between the broker and its mark")
            await self.start_relay()
            return
        child.paused = True
        self.note(f"{child.name} (token {token}) SIGSTOPped with a batch read: a zombie")
        await helpers.wait_for(
            lambda: self.published_after(token), within=60, what="another relay to take over"
        )
        child.signal(signal.SIGCONT)
        child.paused = False
        self.zombie = (child, token)
        self.note(f"{child.name} SIGCONTed after a newer relay published")

    async def kill_output_leader(self) -> None:
        """SIGKILL the broker leading the output topic's partition 0; start it again once the
        relay has published more without it."""
        assert self.cluster is not None
        node = (await self.cluster.leaders(OUTPUT[0]))[0]
        await self.cluster.stop_node(node, signal.SIGKILL)
        self.note(f"kafka node {node}, leader of {OUTPUT[0]}:0, SIGKILLed")
        before = await self.sent()
        await helpers.wait_for(
            lambda: self._more_sent(before), within=120, what="publishing without the leader"
        )
        await self.cluster.start_nodes()
        took = await self.cluster.wait_in_sync([OUTPUT[0]])
        self.note(f"kafka node {node} started again, in sync after {took:.1f}s")

    async def _more_sent(self, before: int) -> bool:
        return await self.sent() > before


async def produce(
    bootstrap_servers: str, topic: str, at_least: int, rng: random.Random, done: asyncio.Event
) -> int:
    """Payments in chunks of 25 (a tenth of them sent twice) until ``done`` is set and
    ``at_least`` went out; how many distinct payments."""
    n = 0
    while n < at_least or not done.is_set():
        chunk = []
        for i in range(n, n + 25):
            value = orjson.dumps({"payment_id": f"p{i}"})
            chunk += [(None, value)] * (2 if rng.random() < 0.1 else 1)
        await helpers.produce(bootstrap_servers, topic, chunk)
        n += 25
        await asyncio.sleep(0.05)  # the pace of the traffic (~500 payments/s), not a wait
    return n


def consumer(handler: Any, topic: str, run: Pipeline, **kw: Any) -> dedup.IdempotentConsumer:
    return dedup.IdempotentConsumer(
        handler,
        topics=[topic],
        group_id=f"g-{topic}",
        bootstrap_servers=run.bootstrap,
        pool=run.pool,
        auto_offset_reset="earliest",
        install_signal_handlers=False,
        **kw,
    )


@pytest.mark.parametrize("seed", SEEDS[scenarios.matrix()], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("mode", MODES[scenarios.matrix()])
async def test_relays_struck_and_a_zombie_lose_nothing_and_double_nothing(
    mode: str, seed: int, chaos_run: driver.RunContext
) -> None:
    faults = ["kill_after_send"] * KILLS + ["pause_before_send"]
    await pipeline(Pipeline(chaos_run, mode, seed), faults)


async def pipeline(run: Pipeline, faults: list[str]) -> None:
    """Run the pipeline through ``faults`` (in a seeded order) and check the oracle."""
    mode, bootstrap = run.mode, run.bootstrap
    run.pool = await dedup.create_pool(run.ctx.dsn, max_size=6)
    try:
        await run.pool.execute(TABLES)
        # On the cluster: three replicas, two in sync for acks=all, as production runs.
        replicas, config = (3, {"min.insync.replicas": "2"}) if run.cluster else (1, None)
        source = await run.topics.create(4, config=config, replicas=replicas)
        output = await run.topics.create(4, config=config, replicas=replicas)
        OUTPUT[0] = output
        for _ in range(3):
            await run.start_relay()
        payments = consumer(
            apply_payment, source, run, namespace="payments",
            key=dedup.keys.json_field("payment_id"),
        )  # fmt: skip
        async with support.running(payments):
            faults_done = asyncio.Event()
            producing = asyncio.create_task(
                produce(bootstrap, source, PAYMENTS[scenarios.matrix()], run.rng, faults_done)
            )
            run.rng.shuffle(faults)
            for fault in faults:
                await run.strike(fault)
            faults_done.set()
            n = await producing
            run.note(f"{n} payments produced")
            await helpers.wait_for(
                lambda: run.pool.fetchval(
                    "SELECT count(DISTINCT payment_id) = $1 FROM chaos_relay_effects", n
                ),
                within=120, what="every payment applied",
            )  # fmt: skip
        await helpers.wait_for(
            lambda: helpers.equal(run.sent(), n), within=120, what="every record published"
        )
        ledger = consumer(
            record_in_ledger, output, run, namespace="ledger",
            key=dedup.keys.header("dedup-key"),
        )  # fmt: skip
        async with support.running(ledger):
            await helpers.wait_for(
                lambda: run.pool.fetchval(
                    "SELECT count(DISTINCT payment_id) = $1 FROM chaos_relay_ledger", n
                ),
                within=120, what="the ledger",
            )  # fmt: skip
        codes = [await c.terminate() for c in run.relays if c.alive]
        committed = await kafka_support.read_topic(bootstrap, output, read_committed=True)
        everything = await kafka_support.read_topic(bootstrap, output)

        effects = Counter(
            r["payment_id"] for r in await run.pool.fetch("SELECT * FROM chaos_relay_effects")
        )
        ledger_rows = Counter(
            r["payment_id"] for r in await run.pool.fetch("SELECT * FROM chaos_relay_ledger")
        )
        on_topic = Counter(dict(r.headers)["dedup-key"] for r in committed)
        story = "\n".join(run.story)
        assert set(codes) <= {0}, f"a relay did not stop cleanly: {codes}\n{story}"
        assert set(effects.values()) == {1} and len(effects) == n, story
        assert set(ledger_rows.values()) == {1} and len(ledger_rows) == n, story
        assert len(on_topic) == n, f"records missing from the topic\n{story}"
        if mode == "exactly_once":
            assert set(on_topic.values()) == {1}, f"a record committed twice\n{story}"
        assert run.zombie is not None
        _, token = run.zombie
        # The zombie's batches marked after a newer holder's first: none.
        late = await run.pool.fetchval(
            "SELECT count(*) FROM dedup.events WHERE kind = 'published' AND key = $1"
            " AND token = $2 AND id > (SELECT min(id) FROM dedup.events"
            " WHERE kind = 'published' AND key = $1 AND token > $2)",
            run.name,
            token,
        )
        print(
            f"relay {mode} {run.name}: {n} payments, {len(committed)} records committed, "
            f"{len(everything)} written (aborted or sent again included), "
            f"{late} batches marked by the zombie after the takeover\n{story}"
        )
        assert late == 0, f"the zombie marked {late} batches after the takeover\n{story}"
        if mode == "exactly_once":
            assert len(committed) == n
    finally:
        for child in run.relays:
            await child.close()
        await run.pool.close()
        await run.topics.delete_all()
