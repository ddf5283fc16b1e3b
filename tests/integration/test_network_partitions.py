"""What a network partition does to the library, one fault at a time, through a proxy.

The consumer (or runner) under test reaches Postgres through a
:class:`dedup_dev.proxy.Proxy` that the test cuts (blackhole: nothing moves,
nothing fails) and heals; the test's own pool goes direct.  The chaos suite's
partition scenarios (tests/chaos/test_partitions.py) run these faults at
random against several processes; each test here pins one of them down.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import orjson

import dedup
from dedup import _faults as faults
from dedup.consumer import _lanes as lanes_
from dedup.consumer import _partitions as partitions_
from dedup.data import _db as db
from dedup_dev import consumer_process, effects, helpers, proxy
from dedup_dev.kafka import Topics

HANDLER_TIMEOUT = 0.5
"""Seconds; the server ends a session idle in its transaction 2.5 s later (+ IDLE_MARGIN)."""
WITHIN = 30.0
"""Seconds for what must happen once the network heals."""


def port_of(dsn: str) -> int:
    return int(dsn.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


async def backends_in_transaction(pool: Any, application_name: str) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
            " AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
            application_name,
        )
    )


async def test_a_commit_held_by_a_cut_past_the_idle_timeout_is_an_outage_not_the_handlers(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    """The batch's COMMIT is queued behind a cut; the server ends the idle session; on the
    heal the consumer gets the server's FATAL.  The handler had returned long before: the
    batch runs again as after any outage, and its message keeps all its attempts (with
    ``max_attempts=1``, one counted against it would dead-letter it)."""
    await pool.execute(effects.EFFECTS)
    topic = await topics.create(partitions=1)
    await helpers.produce(bootstrap_servers, topic, [(None, orjson.dumps({"id": "m0"}))])
    name = f"cut-{topic}"
    async with proxy.Proxy("postgres", port_of(dsn)) as cut:
        proxied = await db.create_pool(
            proxy.with_port(dsn, cut.port), server_settings={"application_name": name}
        )
        consumer = effects.consumer(
            effects.record_effects,
            topic,
            bootstrap_servers,
            proxied,
            batch=True,
            max_attempts=1,
            handler_timeout=HANDLER_TIMEOUT,
        )
        began = asyncio.Event()

        async def cut_before_commit(**_: Any) -> None:
            if not began.is_set():
                began.set()
                cut.cut()

        try:
            with faults.install(faults.Point.BEFORE_COMMIT, cut_before_commit):
                async with effects.running(consumer):
                    await asyncio.wait_for(began.wait(), WITHIN)

                    async def ended() -> bool:
                        return not await backends_in_transaction(pool, name)

                    await helpers.wait_for(ended, within=WITHIN, what="the cut session ended")
                    cut.heal()
                    await helpers.wait_for(
                        lambda: effects.handled(consumer, 1), within=WITHIN, what="m0 handled"
                    )
        finally:
            await proxied.close()
    assert await effects.effect_counts(pool) == (1, 1)
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    assert consumer.stats["processed"] == 1


LEASE_TTL = 2.0
"""Seconds of the cut runner's lease."""
TOLD_WITHIN = LEASE_TTL + 1.5
"""Seconds from the cut by which the job must know: the ttl after the last renewal, and
one renewal period (a third of the ttl) for the renewal in flight, and some slack."""


async def test_a_runner_cut_off_from_postgres_tells_its_job_the_lease_is_lost_during_the_cut(
    dsn: str, pool: Any
) -> None:
    """The watchdog's renewals go nowhere: by the lease's expiry the job is cancelled and
    ``on_lease_lost`` called, while the network is still cut (the ``lease_lost`` event
    can't be written then; it was written first, and hung, before)."""
    task = f"cut_{uuid.uuid4().hex[:8]}"
    async with proxy.Proxy("postgres", port_of(dsn)) as cut:
        proxied = await db.create_pool(proxy.with_port(dsn, cut.port))
        working = asyncio.Event()
        told = asyncio.Event()
        cancelled = asyncio.Event()

        async def job(run: dedup.TaskRun) -> None:
            working.set()
            try:
                await asyncio.Event().wait()  # works until told to stop
            except asyncio.CancelledError:
                cancelled.set()
                raise

        runner = dedup.TaskRunner(
            pool=proxied, holder="cut", on_lease_lost=lambda run, error: told.set()
        )
        try:
            running = asyncio.ensure_future(runner.run(task, "k", job, lease_ttl=LEASE_TTL))
            await asyncio.wait_for(working.wait(), WITHIN)
            cut.cut()
            await asyncio.wait_for(told.wait(), TOLD_WITHIN)
            assert cancelled.is_set()
            assert not running.done() or running.exception() is None
            cut.heal()
            outcome = await asyncio.wait_for(running, WITHIN)
        finally:
            cut.heal()  # a failed wait above must not leave the pool's close hanging
            await proxied.close()
    assert outcome.status == "failed"
    assert "could not be renewed before it expired" in (outcome.error or "")
    kinds = [
        r["kind"]
        for r in await pool.fetch(
            "SELECT kind FROM dedup.events WHERE namespace = $1 ORDER BY id", task
        )
    ]
    assert "lease_lost" in kinds, kinds


SHUTDOWN_TIMEOUT = 2.0
"""Seconds the cut consumer's batches in flight get on SIGTERM (it has none)."""
STOPS_WITHIN = SHUTDOWN_TIMEOUT + partitions_.OWNER_LOOK_TIMEOUT + lanes_.RELEASE_TIMEOUT + 5.0
"""Seconds from SIGTERM to the exit of a consumer cut off from Postgres: its owner look
given up, its lanes' connections let go, and a few seconds to leave the group."""


async def test_a_consumer_cut_off_from_postgres_stops_on_sigterm_within_its_bound(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    """Its periodic look at its partitions' owners goes into the cut; the fetch loop must
    not wait for it: SIGTERM ends the process, exit 0, while the network is still cut."""
    await pool.execute(effects.EFFECTS)
    topic = await topics.create(partitions=1)
    await helpers.produce(
        bootstrap_servers, topic, [(None, orjson.dumps({"id": f"m{i}"})) for i in range(3)]
    )
    async with proxy.Proxy("postgres", port_of(dsn)) as cut:
        args = [
            *("--dsn", proxy.with_port(dsn, cut.port), "--bootstrap-servers", bootstrap_servers),
            *("--topic", topic, "--group", f"g-{topic}"),
            *("--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
        ]
        async with consumer_process.started(*args) as child:

            async def applied() -> bool:
                return await effects.effect_counts(pool) == (3, 3)

            await helpers.wait_for(applied, within=WITHIN, what="the three records applied")
            cut.cut()

            async def looking() -> bool:
                return cut.traffic.held > 0  # the owner look's statement went into the cut

            await helpers.wait_for(looking, within=WITHIN, interval=0.05, what="a look")
            child.signal(signal.SIGTERM)
            assert await child.wait(within=STOPS_WITHIN) == 0, child.stderr_tail()
            cut.heal()
