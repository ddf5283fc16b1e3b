"""The driver of a chaos run: processes, traffic, the fault schedule, recovery times, the oracle.

A consumer run (:class:`ConsumerRun`) starts the consumer processes of
:mod:`tests.chaos.consumer_child` in one group, waits until the group owns
every partition, then produces the seeded traffic while the seeded schedule
strikes.  Faults (``Fault.kind``):

``kill_before_commit`` / ``kill_after_commit``  arm the failpoint on a member that
    owns partitions; it SIGKILLs itself inside its next batch; respawned later
``pause_in_batch``  the member SIGSTOPs itself with a batch written, not committed;
    SIGCONT once others took its partitions over and moved on
``pause_before_begin``  the member SIGSTOPs itself with a turn's records taken,
    before its transaction begins; SIGCONT once others took its partitions over:
    the turn goes on under its old token (the fence refuses it)
``pause_between``  SIGSTOP a member wherever it is; SIGCONT likewise
``kafka_restart`` / ``kafka_kill``  the broker stopped (SIGTERM / SIGKILL) and started
``pg_crash``  ``pg_ctl stop -m immediate``, then started again
``pg_terminate``  ``pg_terminate_backend`` of a member's backend inside a transaction
``join`` / ``leave_term`` / ``leave_kill``  storm members come and go
``slow``  a member's next batch works longer than ``max.poll.interval.ms``
``replay``  production ends, the topic is drained, the group is stopped, the
    stored offsets are set back to the earliest, the group starts again and one
    member is killed at its first batch of the replay
``hang``  a record whose handler awaits forever goes to a seeded partition; it
    must be cancelled at ``handler_timeout``, retried and dead-lettered, while
    the owner's other partitions keep moving
``pg_failover``  replication held up, the primary killed, its standby promoted
    (a run of :class:`tests.chaos.pg_failover.FailoverRun`, through ``inject_other``)

Recovery time of a fault: from the moment the fault is over (the member died,
the broker or Postgres answers again; for a pause, from SIGSTOP) until every
partition it touched has moved its stored offset forward again (or, once
production is over, caught up).  The next fault waits for it (storm faults
excepted), so each figure belongs to one fault.
After the schedule, production stops, the group drains the topic, members are
stopped with SIGTERM (each must exit 0), and the oracle checks everything.

A task run (:class:`TaskRunRun`) races runners of :mod:`tests.chaos.task_child`
per business key and kills or pauses the one that works (see
:func:`tests.chaos.scenarios.tasks_schedule`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiokafka
import aiokafka.errors
import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from dedup.data import _db as db
from dedup_dev import helpers
from dedup_dev.children import Child
from tests.chaos import oracle, report, scenarios
from tests.chaos.services import ChaosServices, ServicesError

T = TypeVar("T")

RUN_LIMIT = {"tiny": 240.0, "short": 240.0, "full": 600.0}
DRAIN_WITHIN = 120.0
RECOVERY_WITHIN = 120.0
SNAPSHOT_EVERY = 1.0
TASK_TTL = 2.0
"""Seconds of the task runners' leases (their watchdogs renew every third of it)."""
OVERLAPPING = frozenset({"join", "leave_term", "leave_kill", "slow"})
"""Storm faults follow each other without waiting for the group to settle."""


@dataclass
class RunContext:
    """What a run needs from the session: the services, its database, a folder for logs."""

    services: ChaosServices
    dsn: str
    logs: Path


class Run:
    """What consumer and task runs share: the story, the children, Postgres with retries."""

    def __init__(
        self, ctx: RunContext, scenario: scenarios.Scenario, seed: int, matrix: str
    ) -> None:
        self.ctx = ctx
        self.scenario = scenario
        self.seed = seed
        self.matrix = matrix
        self.size = scenario.sizes[matrix]
        self.faults = scenarios.schedule(scenario, seed, self.size)
        self.result = report.Result(scenario.name, seed, matrix)
        self.children: list[Child] = []
        self.story: list[str] = []
        self.started = time.monotonic()
        self.pool: Any = None
        self.tasks: list[asyncio.Task[Any]] = []

    def note(self, text: str) -> None:
        self.story.append(f"{time.monotonic() - self.started:7.2f}s {text}")

    def violation(self, text: str) -> None:
        self.note(f"VIOLATION {text}")
        self.result.violations.append(text)

    async def q(self, call: Callable[[Any], Awaitable[T]], within: float = 90.0) -> T:
        """Run ``call(pool)``, retrying while Postgres is down or restarting."""
        deadline = time.monotonic() + within
        while True:
            try:
                return await call(self.pool)
            except Exception as exc:
                if not db.is_retriable(exc) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def background(self, coro: Awaitable[Any]) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    async def spawn(self, module: str, args: list[str], name: str, env: dict[str, str]) -> Child:
        child = await Child.start(module, args, name=name, logs=self.ctx.logs, env=env)
        self.children.append(child)
        await child.expect("READY", within=60)
        return child

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for c in self.children:
            await c.close()
        if self.pool is not None:
            await self.pool.close()

    def check_exits(self) -> None:
        """Every child the run did not strike ended with exit code 0."""
        for c in self.children:
            if not c.struck and c.proc.returncode not in (0, None):
                self.violation(
                    f"{c.name} exited with {c.proc.returncode} without being struck:\n"
                    f"{c.stderr_tail()}"
                )

    def finish(self) -> report.Result:
        self.result.seconds = time.monotonic() - self.started
        return self.result


# ------------------------------------------------------------- consumers --


class ConsumerRun(Run):
    """One run of a consumer scenario."""

    replication_factor = 1
    """Of the run's topic (the three-broker runs of :mod:`tests.chaos.kafka_cluster`: 3)."""

    def __init__(
        self,
        ctx: RunContext,
        scenario: scenarios.Scenario,
        seed: int,
        matrix: str,
        broken: str | None = None,
    ) -> None:
        super().__init__(ctx, scenario, seed, matrix)
        suffix = uuid.uuid4().hex[:6]
        self.group = f"chaos-{scenario.name}-{seed}-{suffix}"
        self.topic = self.group
        self.broken = broken
        self.result.broken = broken
        self.bootstrap = ctx.services.bootstrap_servers
        self.slots: dict[int, Child] = {}
        self.generation: dict[int, int] = defaultdict(int)
        self.members: dict[int, Child] = {}
        self.acked: dict[int, int] = defaultdict(int)
        self.snapshots: list[oracle.Snapshot] = []
        self.first_pass = True
        self.production_may_stop = asyncio.Event()
        self.production_done = asyncio.Event()
        self.produced = 0
        self.recovering: asyncio.Future[None] | None = None
        self.producer: Any = None
        self.hangs = 0
        self.member_args: list[str] = []
        """More options for every consumer child (a subclass's)."""

    # ---------------------------------------------------------- members --

    async def start_member(
        self, name: str, *, dsn: str | None = None, bootstrap: str | None = None
    ) -> Child:
        """Start a consumer child on the run's database and broker (or ``dsn``, ``bootstrap``)."""
        o = self.scenario.options
        args = [
            *("--dsn", dsn or self.ctx.dsn, "--bootstrap-servers", bootstrap or self.bootstrap),
            *("--topic", self.topic, "--group", self.group, "--holder", name),
            *("--batch-size", str(self.size.batch_size), "--hold", str(o.hold)),
            *("--session-timeout-ms", str(o.session_timeout_ms)),
            *("--max-poll-interval-ms", str(o.max_poll_interval_ms)),
            *("--idle-timeout-ms", str(o.idle_timeout_ms)),
            *("--handler", o.handler),
            *self.member_args,
        ]
        env = {"CHAOS_BREAK": self.broken} if self.broken else {}
        child = await self.spawn("tests.chaos.consumer_child", args, name, env)
        self.note(f"started {name}")
        return child

    async def start_slot(self, slot: int) -> Child:
        self.generation[slot] += 1
        child = await self.start_member(
            f"c{slot}.{self.generation[slot]}", **await self.addresses(slot)
        )
        self.slots[slot] = child
        return child

    async def addresses(self, slot: int) -> dict[str, str]:
        """Where slot ``slot``'s members reach Postgres and Kafka (``dsn``, ``bootstrap``):
        the run's own (a subclass's proxies, :mod:`tests.chaos.netsplit`)."""
        return {}

    async def owners(self) -> dict[int, tuple[str, int, int | None]]:
        """partition -> (holder, token, next_offset) as stored."""
        rows = await self.q(
            lambda p: p.fetch(
                'SELECT "partition", holder, token, next_offset FROM dedup.partitions'
                " WHERE group_id = $1 AND topic = $2",
                self.group,
                self.topic,
            )
        )
        return {r["partition"]: (r["holder"], r["token"], r["next_offset"]) for r in rows}

    def live_members(self) -> dict[str, Child]:
        every = [*self.slots.values(), *self.members.values()]
        return {c.name: c for c in every if c.alive and not c.paused}

    async def pick_owner(self, pick: float) -> Child:
        """A live member that owns partitions: ``pick`` of them sorted by name."""

        async def candidates() -> list[Child]:
            owned = {h for h, _, _ in (await self.owners()).values()}
            live = self.live_members()
            return [live[n] for n in sorted(owned & set(live))]

        found = await helpers.wait_for(candidates, within=60, what="a member that owns partitions")
        return found[min(int(pick * len(found)), len(found) - 1)]

    async def offsets_of(self, holder: str | None) -> dict[int, int | None]:
        """Stored offsets of ``holder``'s partitions (all partitions for None)."""
        return {
            p: n for p, (h, _, n) in (await self.owners()).items() if holder is None or h == holder
        }

    # ---------------------------------------------------------- recovery --

    def watch(self, label: str, t0: float, affected: dict[int, int | None]) -> None:
        """Record how long until every affected partition moves on."""
        if affected:
            self.recovering = asyncio.ensure_future(self._recovery(label, t0, affected))
            self.tasks.append(self.recovering)

    async def _recovery(self, label: str, t0: float, affected: dict[int, int | None]) -> None:
        while True:
            try:
                now = await self.offsets_of(None)
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise
                now = {}
            done = all(
                (n := now.get(p)) is not None
                and (
                    (base is None or n > base)
                    or (self.production_done.is_set() and n >= self.acked[p])
                )
                for p, base in affected.items()
            )
            if done:
                took = time.monotonic() - t0
                self.result.recoveries.append(took)
                self.note(f"recovered from {label} in {took:.1f}s")
                return
            await asyncio.sleep(0.1)

    async def snapshots_every(self, seconds: float) -> None:
        """Snapshots all along the run (skipped while Postgres is down)."""
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.snap("periodic", within=0.0)
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise

    async def snap(self, label: str, within: float = 90.0) -> None:
        async def take(pool: Any) -> oracle.Snapshot:
            async with pool.acquire() as conn:
                return await oracle.snapshot(
                    conn, self.group, self.topic, label, first_pass=self.first_pass
                )

        taken = await self.q(take, within)
        taken.label = f"{label} at {time.monotonic() - self.started:.1f}s"
        self.snapshots.append(taken)

    # ---------------------------------------------------------- traffic --

    async def produce(self) -> None:
        messages = scenarios.Messages(self.scenario, self.seed, self.size.partitions)
        producer = aiokafka.AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            linger_ms=2,
            request_timeout_ms=5000,
            enable_idempotence=False,
        )
        await producer.start()
        self.producer = producer
        try:
            while self.produced < self.size.messages or not self.production_may_stop.is_set():
                for send in messages.next():
                    await self._send(producer, send)
                    self.produced += 1
                await asyncio.sleep(1 / self.size.rate)
        finally:
            await producer.stop()
            self.production_done.set()
            self.note(f"production done: {self.produced} records")

    async def _send(self, producer: Any, send: scenarios.Send) -> int:
        deadline = time.monotonic() + 120
        while True:
            try:
                meta = await asyncio.wait_for(
                    producer.send_and_wait(
                        self.topic,
                        send.value,
                        key=send.key,
                        partition=send.partition,
                        headers=list(send.headers),
                    ),
                    15,
                )
            except (aiokafka.errors.KafkaError, TimeoutError) as exc:
                # Sent again: if the first try did reach the log, the topic now holds a
                # producer-level duplicate, which the oracle counts like any other copy.
                if time.monotonic() > deadline:
                    raise
                self.note(f"produce failed, sending again: {exc!r}")
                await asyncio.sleep(0.5)
                continue
            self.acked[meta.partition] = max(self.acked[meta.partition], meta.offset + 1)
            return int(meta.offset)

    async def end_offsets(self) -> dict[int, int]:
        consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=self.bootstrap)
        await consumer.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in range(self.size.partitions)]
            end = await consumer.end_offsets(tps)
        finally:
            await consumer.stop()
        return {tp.partition: n for tp, n in end.items()}

    async def diagnose_stall(self) -> None:
        """Name a partition its owner stopped working on although nobody took it over."""
        rows = await self.q(
            lambda p: p.fetch(
                "SELECT e.resource, e.holder, e.token FROM dedup.events e"
                " JOIN dedup.partitions p"
                "   ON e.resource = p.group_id || ':' || p.topic || ':' || p.\"partition\""
                " WHERE e.kind = 'stale_rejected' AND e.namespace = $1"
                "   AND e.token = p.token AND e.holder = p.holder",
                self.group,
            )
        )
        for r in rows:
            self.violation(
                f"stalled: {r['holder']} stopped work on {r['resource']} as if a newer holder "
                f"had taken it, but its token {r['token']} is still the partition's current "
                "token (a batch retried after a commit whose answer was lost?)"
            )

    async def drain(self, label: str) -> None:
        await self.production_done.wait()
        end = await self.end_offsets()

        async def caught_up() -> bool:
            now = await self.offsets_of(None)
            return all(now.get(p) == n for p, n in end.items())

        self.note(f"draining ({label}) to {end}")
        try:
            await helpers.wait_for(
                caught_up, within=DRAIN_WITHIN, what=f"the group to drain ({label})"
            )
        except AssertionError as exc:
            # Go on to the oracle: it names what was left unapplied.
            self.violation(str(exc))
            await self.diagnose_stall()
            return
        self.note(f"drained ({label})")

    # ----------------------------------------------------------- faults --

    async def inject(self, f: scenarios.Fault) -> None:
        self.note(f"fault {f.describe()}")
        kind = f.kind
        if kind in ("kill_before_commit", "kill_after_commit"):
            await self._kill_in_batch(f, kind.removeprefix("kill_"))
        elif kind == "pause_in_batch":
            await self._pause(f, armed="pause")
        elif kind == "pause_before_begin":
            await self._pause(f, armed="pause_before_begin")
        elif kind == "pause_between":
            await self._pause(f, armed=None)
        elif kind in ("kafka_restart", "kafka_kill"):
            await self.ctx.services.stop_kafka(kill=kind == "kafka_kill")
            self.note("kafka stopped" + (" (SIGKILL)" if kind == "kafka_kill" else ""))
            await asyncio.sleep(f.wait)
            await self.ctx.services.start_kafka()
            self.note("kafka is back")
            self.watch(kind, time.monotonic(), await self.offsets_of(None))
        elif kind == "pg_crash":
            await self.ctx.services.crash_postgres()
            self.note("postgres crashed")
            await asyncio.sleep(f.wait)
            await self.ctx.services.start_postgres()
            self.note("postgres is back")
            self.watch(kind, time.monotonic(), await self.offsets_of(None))
        elif kind == "pg_terminate":
            await self._terminate_backend(f)
        elif kind == "join":
            t0, before = time.monotonic(), await self.offsets_of(None)
            self.members[f.member] = await self.start_member(f"s{f.member}")
            self.watch(f"join of s{f.member}", t0, before)
        elif kind in ("leave_term", "leave_kill"):
            await self._leave(f, kill=kind == "leave_kill")
        elif kind == "slow":
            child = await self.pick_owner(f.pick)
            n = len(child.lines)
            child.send(f"slow {f.arg:.2f}")
            await child.expect("SLOW", after=n, within=30)
            t0, affected = time.monotonic(), await self.offsets_of(child.name)
            self.note(f"{child.name} is in a {f.arg:.1f}s batch")
            self.watch(f"slow batch of {child.name}", t0, affected)
        elif kind == "replay":
            await self._replay(f)
        elif kind == "hang":
            await self._hang(f)
        else:
            await self.inject_other(f)
        self.result.faults += 1
        await self.snap(f"after {kind}")
        if self.recovering is not None and kind not in OVERLAPPING:
            # The next fault waits, so each recovery time is that of one fault.
            try:
                await asyncio.wait_for(asyncio.shield(self.recovering), RECOVERY_WITHIN)
            except TimeoutError:
                self.violation(f"no recovery within {RECOVERY_WITHIN:.0f}s after {f.describe()}")
                await self.diagnose_stall()
        self.recovering = None

    async def inject_other(self, f: scenarios.Fault) -> None:
        """A fault of a subclass's own kind (see :mod:`tests.chaos.pg_failover`)."""
        raise AssertionError(f"unknown fault kind {f.kind!r}")

    async def _kill_in_batch(self, f: scenarios.Fault, when: str) -> None:
        child = await self.pick_owner(f.pick)
        n = len(child.lines)
        child.send(when)
        child.struck = True
        try:
            _, line = await child.expect("FAILPOINT", after=n, within=30)
            self.note(f"{child.name}: {line}")
        except AssertionError:
            self.note(f"{child.name} had no batch in 30 s; killed between batches")
            child.signal(signal.SIGKILL)
        await child.wait()
        t0, affected = time.monotonic(), await self.offsets_of(child.name)
        self.watch(f"{when} kill of {child.name}", t0, affected)
        await self.snap(f"after the {when} kill of {child.name}")  # before anyone moves on
        await asyncio.sleep(f.wait)
        slot = next(s for s, c in self.slots.items() if c is child)
        await self.start_slot(slot)

    async def _pause(self, f: scenarios.Fault, *, armed: str | None) -> None:
        """SIGSTOP a member (itself, where ``armed`` strikes), SIGCONT once others took over."""
        child = await self.pick_owner(f.pick)
        n = len(child.lines)
        token = None
        if armed is not None:
            child.send(armed)
            _, line = await child.expect("FAILPOINT", after=n, within=30)
            token = int(line.split()[-1])
            self.note(f"{child.name} stopped itself: {line}")
        else:
            child.signal(signal.SIGSTOP)
            self.note(f"{child.name} stopped")
        child.paused = True
        t0, affected = time.monotonic(), await self.offsets_of(child.name)

        async def taken_over() -> bool:
            now = await self.owners()
            return all(
                holder != child.name and n is not None and (base is None or n > base)
                for p, base in affected.items()
                for holder, _, n in [now[p]]
            )

        await helpers.wait_for(taken_over, within=90, what=f"others to take over from {child.name}")
        took = time.monotonic() - t0
        self.result.recoveries.append(took)
        self.note(f"{child.name}'s partitions {sorted(affected)} taken over in {took:.1f}s")
        await asyncio.sleep(f.wait)
        marks = await self.marks()
        child.signal(signal.SIGCONT)
        child.paused = False
        self.note(f"{child.name} continued")
        if token is None:
            return

        async def settled() -> bool:
            return await self.settled(child.name, token, marks)

        with contextlib.suppress(AssertionError):
            await helpers.wait_for(settled, within=30, what=f"{child.name}'s batch to settle")
        self.note(f"{child.name}'s batch in flight settled")

    async def marks(self) -> Any:
        """The newest event and batch ids (``event``, ``batch``): what a member does from now
        on comes after them."""
        return await self.q(
            lambda p: p.fetchrow(
                "SELECT (SELECT coalesce(max(id), 0) FROM dedup.events) AS event,"
                " (SELECT coalesce(max(id), 0) FROM chaos_batches) AS batch"
            )
        )

    async def settled(self, holder: str, token: int, marks: Any) -> bool:
        """Whether ``holder``'s batch under ``token`` in flight since ``marks`` was refused
        (the fence) or committed (a broken build)."""
        return bool(
            await self.q(
                lambda p: p.fetchval(
                    "SELECT EXISTS (SELECT FROM dedup.events WHERE id > $1"
                    "               AND kind = 'stale_rejected' AND holder = $3)"
                    " OR EXISTS (SELECT FROM chaos_batches WHERE id > $2"
                    "            AND holder = $3 AND token = $4)",
                    marks["event"],
                    marks["batch"],
                    holder,
                    token,
                )
            )
        )

    async def _terminate_backend(self, f: scenarios.Fault) -> None:
        async def in_transaction() -> list[Any]:
            return list(
                await self.q(
                    lambda p: p.fetch(
                        "SELECT pid, application_name FROM pg_stat_activity"
                        " WHERE datname = current_database() AND application_name LIKE 'chaos:%'"
                        " AND xact_start IS NOT NULL AND pid <> pg_backend_pid()"
                        " ORDER BY application_name, pid"
                    )
                )
            )

        found = await helpers.wait_for(
            in_transaction, within=30, interval=0.005, what="a member's backend in a transaction"
        )
        victim = found[min(int(f.pick * len(found)), len(found) - 1)]
        holder = victim["application_name"].removeprefix("chaos:")
        affected = await self.offsets_of(holder)
        t0 = time.monotonic()
        await self.q(lambda p: p.fetchval("SELECT pg_terminate_backend($1)", victim["pid"]))
        self.note(f"terminated backend {victim['pid']} of {holder} in a transaction")
        self.watch(f"terminated backend of {holder}", t0, affected)

    async def _leave(self, f: scenarios.Fault, *, kill: bool) -> None:
        child = self.members.get(f.member)
        if child is None or not child.alive:
            return
        t0, affected = time.monotonic(), await self.offsets_of(child.name)
        if kill:
            await child.kill()
            self.note(f"{child.name} killed")
        else:

            async def leave() -> None:
                code = await child.terminate()
                self.note(f"{child.name} left with exit code {code}")

            self.background(leave())
        self.watch(f"{'kill' if kill else 'exit'} of {child.name}", t0, affected)

    async def _hang(self, f: scenarios.Fault) -> None:
        """Send a record whose handler hangs; the owner's other partitions must keep moving
        until it is dead-lettered (the recovery time: from the hang to the dead letter)."""
        partition = min(int(f.pick * self.size.partitions), self.size.partitions - 1)
        offset = await self._send(self.producer, scenarios.hang_record(self.hangs, partition))
        self.hangs += 1
        mark = f"HANG {partition} {offset} "

        async def hung() -> Child | None:
            every = [*self.slots.values(), *self.members.values()]
            return next((c for c in every if any(x.startswith(mark) for x in c.lines)), None)

        child = await helpers.wait_for(hung, within=60, what=f"a handler to hang at {mark}")
        t0, before = time.monotonic(), await self.offsets_of(None)
        self.note(f"{child.name}'s handler hangs at partition {partition} offset {offset}")

        async def dead_lettered() -> bool:
            return bool(
                await self.q(
                    lambda p: p.fetchval(
                        "SELECT EXISTS (SELECT FROM dedup.dead_letters WHERE topic = $1"
                        ' AND "partition" = $2 AND "offset" = $3)',
                        self.topic,
                        partition,
                        offset,
                    )
                )
            )

        await helpers.wait_for(
            dead_lettered, within=RECOVERY_WITHIN, what=f"the hung record at {mark}dead-lettered"
        )
        took = time.monotonic() - t0
        self.result.recoveries.append(took)
        self.note(f"the hung record of partition {partition} dead-lettered after {took:.1f}s")
        after = await self.offsets_of(None)
        mine = {p for p, (h, _, _) in (await self.owners()).items() if h == child.name}
        # The hang holds up its own partition only: every other partition of its
        # owner that had records waiting moved meanwhile.
        stuck = [
            (p, base)
            for p, base in sorted(before.items())
            if p != partition and p in mine and self.acked[p] > (base or 0) and after.get(p) == base
        ]
        if stuck:
            self.violation(
                f"partitions (partition, offset) {stuck} of {child.name} did not move during "
                f"the {took:.1f}s its handler hung on partition {partition}"
            )

    async def _replay(self, f: scenarios.Fault) -> None:
        self.production_may_stop.set()
        await self.drain("first pass")
        await self.snap("end of the first pass")
        for _, child in sorted(self.slots.items()):
            code = await child.terminate()
            self.note(f"{child.name} stopped for the replay: exit code {code}")
        # What an operator does to replay a topic into a dedup consumer: the
        # offsets live in Postgres, so that is where they are set back.
        self.first_pass = False  # before the reset: no snapshot of the replay passes as a first
        reset = await self.q(
            lambda p: p.execute(
                "UPDATE dedup.partitions SET next_offset = 0 WHERE group_id = $1", self.group
            )
        )
        self.note(f"offsets set back to 0: {reset}")
        for slot in sorted(self.slots):
            await self.start_slot(slot)
        await self._kill_in_batch(f, "after_commit" if f.arg else "before_commit")

    # -------------------------------------------------------------- run --

    async def execute(self) -> report.Result:
        self.note(f"{self.scenario.name} seed {self.seed} ({self.matrix}): {self.size}")
        for f in self.faults:
            self.note(f"scheduled: {f.describe()}")
        self.pool = await asyncpg.create_pool(self.ctx.dsn, min_size=0, max_size=3)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics(
                [NewTopic(self.topic, self.size.partitions, self.replication_factor)]
            )
        finally:
            await admin.close()
        for slot in range(self.size.consumers):
            await self.start_slot(slot)

        async def all_owned() -> bool:
            return len(await self.owners()) == self.size.partitions

        await helpers.wait_for(all_owned, within=60, what="the group to own every partition")
        producer = asyncio.create_task(self.produce())
        self.tasks.append(producer)
        snapshots = asyncio.create_task(self.snapshots_every(SNAPSHOT_EVERY))
        self.tasks.append(snapshots)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for f in self.faults:
            delay = start + f.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.inject(f)
        self.production_may_stop.set()
        await producer
        await self.drain("end")
        snapshots.cancel()
        await self.snap("end")
        for t in self.tasks:
            if t is not producer:
                with contextlib.suppress(asyncio.CancelledError):
                    t.cancel()
                    await t
        for c in list(self.live_members().values()):
            code = await c.terminate()
            self.note(f"{c.name} stopped with exit code {code}")
        self.check_exits()
        for c in self.children:
            for line in c.lines:
                if line.startswith("STATS "):
                    self.note(f"{c.name}: {line}")
        records = await oracle.read_topic(self.bootstrap, self.topic, self.size.partitions)
        async with self.pool.acquire() as conn:
            verdict = await oracle.check_consumer_run(
                conn,
                records,
                self.snapshots,
                group=self.group,
                topic=self.topic,
                passes=1 if self.first_pass else 2,
                accounts=self.scenario.traffic.accounts > 0,
            )
        r = self.result
        r.messages = len(records)
        r.lost, r.doubled, r.dead_lettered = verdict.lost, verdict.doubled, verdict.dead_lettered
        r.stale_refused, r.stale_committed = verdict.stale_refused, verdict.stale_committed
        r.duplicates = verdict.duplicates
        r.violations.extend(verdict.violations)
        # Counted by the server (a crash of Postgres forgets the count so far).
        r.deadlocks = await self.q(
            lambda p: p.fetchval(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            )
        )
        return self.finish()

    async def delete_topic(self) -> None:
        with contextlib.suppress(Exception):
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                await admin.delete_topics([self.topic])
            finally:
                await admin.close()


# ----------------------------------------------------------------- tasks --


class TaskRunRun(Run):
    """One run of the tasks scenario: racing runners per business key, faults, a forced rerun."""

    def __init__(
        self, ctx: RunContext, scenario: scenarios.Scenario, seed: int, matrix: str
    ) -> None:
        super().__init__(ctx, scenario, seed, matrix)
        self.task = f"chaos_{seed}_{uuid.uuid4().hex[:6]}"
        self.keys = [f"2026-01-{i + 1:02d}" for i in range(self.size.faults)]
        self.rng = scenarios.rng_for(scenario.name, seed, "runners")
        self.work = [self.rng.uniform(0.5, 1.5) for _ in self.keys]

    async def runner(
        self,
        key: int,
        name: str,
        *,
        force: bool = False,
        hold: float = 0.0,
        dsn: str | None = None,
        work: float | None = None,
        held: bool = False,
        env: dict[str, str] | None = None,
    ) -> Child:
        """A runner of key ``key`` on the run's database (or ``dsn``), its job working the
        key's seconds (or ``work``); ``held``: its write waits for ``release``."""
        work = self.work[key] if work is None else work
        args = [
            *("--dsn", dsn or self.ctx.dsn, "--task", self.task, "--key", self.keys[key]),
            *("--holder", name, "--ttl", str(TASK_TTL), "--work", f"{work:.2f}"),
            *("--hold", str(hold)),
            *(["--force"] if force else []),
            *(["--held"] if held else []),
        ]
        child = await Child.start(
            "tests.chaos.task_child", args, name=name, logs=self.ctx.logs, env=env
        )
        self.children.append(child)
        return child

    async def task_row(self, key: int) -> Any:
        return await self.q(
            lambda p: p.fetchrow(
                "SELECT state, token FROM dedup.tasks WHERE task = $1 AND business_key = $2",
                self.task,
                self.keys[key],
            )
        )

    async def race(self, f: scenarios.Fault) -> None:
        """Start the key's runners together, strike the one that works, let the rest finish."""
        key = f.member
        hold = 0.6 if f.kind == "pause_writing" else 0.0
        runners = [
            await self.runner(key, f"r{key}.{i}", hold=hold) for i in range(self.size.consumers)
        ]
        mark = "WRITING" if f.kind == "pause_writing" else "WORKING"

        async def first(prefix: str) -> tuple[Child, int]:
            waits = {asyncio.ensure_future(c.expect(prefix, within=60)): c for c in runners}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            winner = next(iter(done))
            _, line = winner.result()
            return waits[winner], int(line.split()[1])

        victim, token = await first(mark)
        t0 = time.monotonic()
        if f.kind == "kill_runner":
            await victim.kill()
            self.note(f"{self.keys[key]}: killed {victim.name} (token {token}) while it worked")
        else:
            victim.signal(signal.SIGSTOP)
            victim.paused = True
            self.note(f"{self.keys[key]}: stopped {victim.name} (token {token}) at {mark}")

        async def done_by_another() -> bool:
            row = await self.task_row(key)
            return bool(row and row["state"] == "succeeded" and row["token"] > token)

        await helpers.wait_for(done_by_another, within=60, what=f"{self.keys[key]} taken over")
        took = time.monotonic() - t0
        self.result.recoveries.append(took)
        self.note(f"{self.keys[key]}: done by another runner {took:.1f}s after the fault")
        if victim.paused:
            await asyncio.sleep(f.wait)
            victim.signal(signal.SIGCONT)
            victim.paused = False
            self.note(f"{self.keys[key]}: {victim.name} continued")
        for c in runners:
            if c.alive:
                await c.wait(within=60)
        self.result.faults += 1

    async def forced_rerun(self, f: scenarios.Fault) -> None:
        key = f.member
        self.note(f"{self.keys[key]}: forced rerun, raced by two plain runs")
        runners = [await self.runner(key, f"f{key}", force=True)]
        runners += [await self.runner(key, f"p{key}.{i}") for i in range(2)]
        for c in runners:
            await c.wait(within=60)
        self.result.faults += 1

    async def execute(self) -> report.Result:
        self.note(
            f"tasks seed {self.seed} ({self.matrix}): {len(self.keys)} keys x "
            f"{self.size.consumers} runners"
        )
        for f in self.faults:
            self.note(f"scheduled: {f.describe()} key={self.keys[f.member]}")
        self.pool = await asyncpg.create_pool(self.ctx.dsn, min_size=0, max_size=3)
        races = [f for f in self.faults if f.kind != "force_rerun"]
        for wave in range(0, len(races), 3):  # three keys at a time: two cores
            await asyncio.gather(*(self.race(f) for f in races[wave : wave + 3]))
        forced = next(f for f in self.faults if f.kind == "force_rerun")
        await self.forced_rerun(forced)
        self.check_exits()
        self.result.messages = sum(
            1 for c in self.children for line in c.lines if line.startswith("OUTCOME")
        )
        async with self.pool.acquire() as conn:
            verdict = await oracle.check_task_run(
                conn, self.task, self.keys, self.keys[forced.member]
            )
        r = self.result
        r.lost, r.doubled = verdict.lost, verdict.doubled
        r.stale_refused, r.stale_committed = verdict.stale_refused, verdict.stale_committed
        r.violations.extend(verdict.violations)
        return self.finish()


# ------------------------------------------------------------------- run --


async def run(
    ctx: RunContext,
    name: str,
    seed: int,
    *,
    matrix: str | None = None,
    broken: str | None = None,
) -> report.Result:
    """Run one scenario with one seed; the result carries the oracle's findings."""
    scenario = scenarios.SCENARIOS[name]
    matrix = matrix or scenarios.matrix()
    the_run: Run
    if scenario.replica:
        from tests.chaos import pg_failover  # it builds on this module

        the_run = pg_failover.FailoverRun(ctx, scenario, seed, matrix, broken)
    elif scenario.tasks:
        the_run = TaskRunRun(ctx, scenario, seed, matrix)
    else:
        the_run = ConsumerRun(ctx, scenario, seed, matrix, broken)
    return await conclude(the_run, matrix)


async def conclude(the_run: Run, matrix: str) -> report.Result:
    """Execute ``the_run`` within the matrix's limit, clean up, print its story."""
    try:
        return await asyncio.wait_for(the_run.execute(), RUN_LIMIT[matrix])
    except (AssertionError, TimeoutError, ServicesError) as exc:
        the_run.violation(f"the run did not complete: {exc!r}")
        the_run.check_exits()
        return the_run.finish()
    finally:
        await the_run.close()
        if isinstance(the_run, ConsumerRun):
            await the_run.delete_topic()
        print("\n".join(the_run.story))
