"""Network partitions: scenarios that cut a process off at its proxies, their figures, a table.

Every consumer slot of a run gets a :class:`Cuts`: a proxy (:mod:`dedup_dev.proxy`)
to the chaos Postgres (the member's DSN names it) and one to the broker's
listener of its slot (its bootstrap address; :mod:`tests.chaos.services` says why
every connection it opens to Kafka goes through it).  The driver's own
connections (producer, snapshots, oracle) go direct.  The consumers, the
traffic and the oracle are those of every consumer scenario
(:class:`tests.chaos.driver.ConsumerRun`); the faults (``Fault.kind``):

``pg_cut_before_commit``  a member's batch is held after its writes; its Postgres
    proxy is cut (blackhole) and the batch let go: its COMMIT is queued behind
    the cut.  Kafka still reaches the member: it keeps its partitions
``pg_cut_in_handler``  the same, held inside the handler, whose next statement is
    queued behind the cut: ``handler_timeout`` cancels it, and the rollback
    goes nowhere either
``flap``  the member's Postgres and Kafka proxies flap for ``Fault.arg`` seconds (see
    :meth:`NetsplitRun._flap`)
``pg_reset_after_commit``  the batch's COMMIT gets through and its answer is held
    (a one-way cut); once it landed, the connection is reset, the answer lost, and
    every new connection is reset for ``Fault.wait`` seconds: the batch's fate is
    in doubt, and the next turn's fence must tell that it landed

A Postgres cut (not a reset) lasts the server's idle-in-transaction timeout
of the member's transactions (``handler_timeout`` + ``IDLE_MARGIN``) and
``Fault.wait`` seconds more, then heals: what the proxy held is delivered, the
COMMIT too (after the server ended that session, it is gone with it).

Figures of each fault, in the run's :class:`Result`:

- **cut → takeover**: for a Postgres cut, until the server has ended every
  session the member had in a transaction at the cut (its locks are free);
- **heal → progress**: until every partition the member owned moves its
  stored offset forward again (or, once production is over, is caught up).

Each fault also checks that the other members' partitions went on meanwhile
(and notes it if the member's partitions changed hands during the cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from dedup_dev import helpers, proxy
from dedup_dev.children import Child
from tests.chaos import driver, oracle, report, scenarios
from tests.chaos.services import KAFKA_SLOTS, kafka_listener_port, kafka_proxy_port

TABLE_START = "<!-- partition-table:start -->"
TABLE_END = "<!-- partition-table:end -->"
SESSION_END_SLACK = 2.0
"""Seconds the server may take past its idle-in-transaction timeout to end a cut session
(its timer fires on time; this is the driver's look at pg_stat_activity on two busy cores)."""
HEAL_BOUND = 12.0
"""Seconds from a heal until every partition of the healed member moves again: the lane's
longest backoff between two tries (``MAX_BACKOFF``, 5 s), a connection attempt that began
in the cut (``DEFAULT_CONNECT_TIMEOUT``, 5 s), and a turn."""
HOLD_WITHIN = 30.0
"""Seconds for a member to reach the batch it was told to hold."""
TASK_LONG_JOB = 60.0
"""Seconds a cut runner's job would work: it must be told it lost its lease long before."""
TASK_TAKEOVER_SLACK = 3.0
"""Seconds past the lease's ttl for the second runner to take it: its next firing
(``REFIRE_EVERY``, 0.25 s) and its claim."""
TASK_TOLD_SLACK = 1.5
"""Seconds past the lease's ttl for the cut runner's job to be told: its watchdog's
deadline is the ttl after its last renewal; the renewal in flight then may take one
renewal period (a third of the ttl) more."""
REBALANCE_SLACK = 10.0
"""Seconds past the group's session timeout for another member to take a cut member's
partitions: the coordinator's rebalance, the survivors' rejoin and their takes."""


def pg_port(dsn: str) -> int:
    """The port of a ``postgresql://user@127.0.0.1:PORT/db`` URL."""
    return int(dsn.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


@dataclass
class Cuts:
    """The proxies of one child process, by service (``postgres``, ``kafka``)."""

    name: str
    proxies: dict[str, proxy.Proxy] = field(default_factory=dict)

    def cut(self, *services: str) -> None:
        for s in services or tuple(self.proxies):
            self.proxies[s].cut()

    def heal(self, *services: str) -> None:
        for s in services or tuple(self.proxies):
            self.proxies[s].heal()

    def reset(self, *services: str) -> None:
        for s in services or tuple(self.proxies):
            self.proxies[s].reset()

    async def close(self) -> None:
        for p in self.proxies.values():
            await p.close()


# -------------------------------------------------------------- scenarios --


@dataclass(frozen=True)
class Cut:
    """One kind of cut: what the member loses, and where its batch is held first."""

    services: tuple[str, ...]
    hold: str | None = None
    """``before_begin``, ``before_commit``, ``in_handler`` (:mod:`tests.chaos.consumer_child`)."""
    answer_lost: bool = False
    """The COMMIT gets through, its answer is held, then every connection is reset."""


IN_TRANSACTION = ("before_commit", "in_handler")
"""Holds inside a transaction: the batch goes on into the cut."""
CUTS = {
    "pg_reset_after_commit": Cut(("postgres",), "before_commit", answer_lost=True),
    "pg_cut_before_commit": Cut(("postgres",), "before_commit"),
    "pg_cut_in_handler": Cut(("postgres",), "in_handler"),
    "kafka_cut_before_begin": Cut(("kafka",), "before_begin"),
    "kafka_cut": Cut(("kafka",)),
    "both_cut_before_commit": Cut(("postgres", "kafka"), "before_commit"),
    "both_cut_in_handler": Cut(("postgres", "kafka"), "in_handler"),
}
"""The cuts by ``Fault.kind``; a scenario's schedule draws from its own (a run of one
fault, the ``tiny`` size of the teeth, gets the first)."""
PG_CUTS = ["pg_reset_after_commit", "pg_cut_before_commit", "pg_cut_in_handler"]
KAFKA_CUTS = ["kafka_cut_before_begin", "kafka_cut"]
BOTH_CUTS = ["both_cut_before_commit", "both_cut_in_handler"]
TASK_CUTS = ["task_cut_writing", "task_cut_working"]
FLAP_CUT = (0.1, 0.5)
"""Seconds each cut of a flapping link lasts (and a reset after it): shorter than every
timeout in play, so each cut alone is only a delay."""
FLAP_HEALED = (0.1, 0.5)
"""Seconds the flapping link passes between two cuts."""
FLAP_ANSWERS_ONLY = 0.5
"""Share of a flap's cuts that hold only the answers (requests still arrive)."""
FLAP_RESET = 0.3
"""Share of a flap's cuts that end in a reset: what was held is lost, answers too."""
FLAP_COMMIT_LOST = 0.2
"""Share of a flap's cuts that fall right behind a COMMIT of the member's (the next one it
sends within the cut's time) and end in a reset: the COMMIT lands, its answer is lost."""
FLAP_COMMIT_LANDS = 0.05
"""Seconds between a COMMIT's arrival and the reset that loses its answer: the server has
carried it out by then (it takes a millisecond here)."""


def flap_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    """One flapping link, for as long as the traffic lasts (``arg``: seconds)."""
    return [
        scenarios.Fault(
            rng.uniform(1.0, 2.0), "flap", pick=rng.random(), arg=size.messages / size.rate
        )
    ]


def task_cut_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    """One cut per business key, as often of each kind (a run of one: a write held);
    ``wait``: how long each lasts past the takeover."""
    kinds = scenarios._balanced(rng, TASK_CUTS, size.faults) if size.faults > 1 else TASK_CUTS[:1]
    return [
        scenarios.Fault(0.0, kind, wait=rng.uniform(0.5, 2.0), member=key)
        for key, kind in enumerate(kinds)
    ]


def cut_schedule(kinds: list[str]) -> scenarios.Schedule:
    """A schedule of cuts of ``kinds``, as often each (the first first in a run of one);
    ``wait``: how long a cut lasts past what it must bring about (the server's idle
    timeout, the takeover), or a reset lasts."""

    def schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
        drawn = scenarios._balanced(rng, kinds, size.faults) if size.faults > 1 else kinds[:1]
        return [
            scenarios.Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.5, 2.0))
            for at, kind in zip(scenarios._spread(rng, size.faults, 1.0, 2.0), drawn, strict=True)
        ]

    return schedule


SCENARIOS: dict[str, scenarios.Scenario] = {
    s.name: s
    for s in [
        scenarios.Scenario(
            "pg_cut",
            "a consumer cut off from Postgres mid-transaction (before its COMMIT, inside its "
            "handler) past handler_timeout and the session's idle timeout, Kafka still "
            "reaching it; then healed",
            {
                "tiny": scenarios.Size(messages=200, faults=1, rate=60),
                "short": scenarios.Size(messages=300, faults=3, rate=80),
                "full": scenarios.Size(
                    messages=1200, faults=4, partitions=4, consumers=3, rate=100
                ),
            },
            cut_schedule(PG_CUTS),
        ),
        scenarios.Scenario(
            "kafka_cut",
            "a consumer cut off from Kafka (its membership expires, its partitions move) "
            "while Postgres still reaches it, a turn of it held from before the cut; healed",
            {
                "tiny": scenarios.Size(messages=200, faults=1, rate=60),
                "full": scenarios.Size(
                    messages=1200, faults=4, partitions=4, consumers=3, rate=100
                ),
            },
            cut_schedule(KAFKA_CUTS),
        ),
        scenarios.Scenario(
            "both_cut",
            "a consumer cut off from Kafka and Postgres mid-transaction; healed after "
            "another member took its partitions over",
            {
                "tiny": scenarios.Size(messages=200, faults=1, rate=60),
                "full": scenarios.Size(
                    messages=1200, faults=4, partitions=4, consumers=3, rate=100
                ),
            },
            cut_schedule(BOTH_CUTS),
        ),
        scenarios.Scenario(
            "flap",
            "a consumer's link to Kafka and Postgres flaps for a minute: cut (both ways, "
            "or its answers only) and healed every few hundred ms, some cuts ending in a reset, "
            "some right behind a COMMIT whose answer is lost",
            {
                "tiny": scenarios.Size(messages=600, faults=1, rate=60),
                "full": scenarios.Size(
                    messages=6000, faults=1, partitions=4, consumers=3, rate=100
                ),
            },
            flap_schedule,
        ),
        scenarios.Scenario(
            "task_cut",
            "a task runner cut off from Postgres past its lease (working, or with its write "
            "in flight) while a second runner takes over; then healed",
            {
                "tiny": scenarios.Size(messages=0, faults=1, consumers=2),
                "full": scenarios.Size(messages=0, faults=4, consumers=2),
            },
            task_cut_schedule,
            tasks=True,
        ),
    ]
}


def names() -> list[str]:
    """The partition scenarios this session's matrix runs."""
    matrix = scenarios.matrix()
    return [name for name, s in SCENARIOS.items() if matrix in s.sizes]


@dataclass
class Result(report.Result):
    """A run's figures, and each fault's time from the cut to the takeover and from the
    heal to progress."""

    takeovers: list[float] = field(default_factory=list)
    progress: list[float] = field(default_factory=list)
    told: list[float] = field(default_factory=list)
    """Task cuts: seconds from the cut until the cut runner's job was told it lost the lease."""

    def line(self) -> str:
        def worst(values: list[float]) -> str:
            return f"{max(values):.1f}s" if values else "-"

        return (
            f"{super().line()} cut-to-takeover={worst(self.takeovers)}"
            f" heal-to-progress={worst(self.progress)}"
            + (f" cut-to-told-lost={worst(self.told)}" if self.told else "")
        )


RESULTS: list[Result] = []


# -------------------------------------------------------------------- run --


class NetsplitRun(driver.ConsumerRun):
    """A consumer run whose members reach Postgres and Kafka through proxies of their own."""

    def __init__(
        self,
        ctx: driver.RunContext,
        scenario: scenarios.Scenario,
        seed: int,
        matrix: str,
        broken: str | None = None,
    ) -> None:
        super().__init__(ctx, scenario, seed, matrix, broken)
        if self.size.consumers > KAFKA_SLOTS:
            raise ValueError(f"{scenario.name}: more consumers than proxy slots ({KAFKA_SLOTS})")
        self.result = Result(scenario.name, seed, matrix)
        self.result.broken = broken
        self.cuts: dict[int, Cuts] = {}

    @property
    def figures(self) -> Result:
        assert isinstance(self.result, Result)
        return self.result

    async def addresses(self, slot: int) -> dict[str, str]:
        cuts = self.cuts.get(slot)
        if cuts is None:
            cuts = Cuts(f"c{slot}")
            cuts.proxies["postgres"] = await proxy.Proxy(
                f"c{slot}/postgres", pg_port(self.ctx.dsn)
            ).start()
            cuts.proxies["kafka"] = await proxy.Proxy(
                f"c{slot}/kafka", kafka_listener_port(slot), port=kafka_proxy_port(slot)
            ).start()
            self.cuts[slot] = cuts
        return {
            "dsn": proxy.with_port(self.ctx.dsn, cuts.proxies["postgres"].port),
            "bootstrap": cuts.proxies["kafka"].address,
        }

    def slot_of(self, child: Child) -> int:
        return next(s for s, c in self.slots.items() if c is child)

    async def close(self) -> None:
        for cuts in self.cuts.values():
            cuts.heal()  # the members stop cleanly
        await super().close()
        for cuts in self.cuts.values():
            await cuts.close()

    # ----------------------------------------------------------- faults --

    async def inject_other(self, f: scenarios.Fault) -> None:
        if f.kind == "flap":
            await self._flap(f)
            return
        cut = CUTS.get(f.kind)
        if cut is None:
            await super().inject_other(f)
            return
        await self._cut(f, cut)

    async def _flap(self, f: scenarios.Fault) -> None:
        """Flap a member's link (its Postgres and Kafka proxies) for ``f.arg`` seconds: cut
        (both ways, or its answers only) for 0.1-0.5 s, sometimes reset after that, or cut
        right behind its next COMMIT and reset (the answer lost); healed for 0.1-0.5 s;
        again and again.  Then time its way back."""
        child = await self.pick_owner(f.pick)
        cuts = self.cuts[self.slot_of(child)]
        rng = scenarios.rng_for(self.scenario.name, self.seed, f"flap at {f.at}")
        before = await self.offsets_of(None)
        owned = {p: t for p, (_, t, _) in (await self.owners()).items()}
        t0 = time.monotonic()
        cycles = resets = 0
        postgres = cuts.proxies["postgres"]
        lost = 0
        while time.monotonic() - t0 < f.arg:
            cut_for = rng.uniform(*FLAP_CUT)
            if rng.random() < FLAP_COMMIT_LOST:
                # The link breaks right behind a COMMIT: it lands, its answer is lost.
                postgres.cut_after(b"COMMIT")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(postgres.tripped.wait(), cut_for)
                    await asyncio.sleep(FLAP_COMMIT_LANDS)
                    lost += 1
                cuts.reset()
                resets += 1
            else:
                answers_only = rng.random() < FLAP_ANSWERS_ONLY
                for service in cuts.proxies.values():
                    service.cut(to_service=not answers_only)
                await asyncio.sleep(cut_for)
                if rng.random() < FLAP_RESET:
                    cuts.reset()
                    resets += 1
                    await asyncio.sleep(rng.uniform(*FLAP_CUT))
            cuts.heal()
            cycles += 1
            await asyncio.sleep(rng.uniform(*FLAP_HEALED))
        t_heal = time.monotonic()
        self.note(
            f"{child.name}'s link flapped for {t_heal - t0:.1f}s: {cycles} cuts, {resets} of "
            f"them ending in a reset, {lost} right behind a COMMIT whose answer was lost"
        )
        after = await self.owners()
        moved = sorted(p for p, t in owned.items() if after[p][1] != t)
        if moved:
            self.note(f"partitions {moved} changed hands during the flap")
        stuck = [
            p
            for p, base in sorted(before.items())
            if self.acked[p] > (base or 0) and after[p][2] == base
        ]
        if stuck:
            self.violation(f"partitions {stuck} did not move during {child.name}'s flap")
        mine = {p: n for p, (h, _, n) in after.items() if h == child.name}
        await self._back_to_work(child, t_heal, (await self.marks())["batch"], mine)

    async def _committed(self, holder: str, failpoint: str) -> None:
        """Wait until the batch held at ``failpoint`` (``FAILPOINT <what> <partition> <first
        offset> <token>``) committed."""
        partition, first, token = (int(x) for x in failpoint.split()[2:5])

        async def landed() -> bool:
            return bool(
                await self.q(
                    lambda p: p.fetchval(
                        "SELECT EXISTS (SELECT FROM chaos_batches WHERE holder = $1"
                        ' AND "partition" = $2 AND first_offset = $3 AND token = $4)',
                        holder,
                        partition,
                        first,
                        token,
                    )
                )
            )

        await helpers.wait_for(landed, within=HOLD_WITHIN, what=f"{holder}'s COMMIT to land")

    async def _in_transaction(self, holder: str) -> set[int]:
        """The backends of ``holder`` inside a transaction now."""
        rows = await self.q(
            lambda p: p.fetch(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
                " AND xact_start IS NOT NULL",
                f"chaos:{holder}",
            )
        )
        return {r["pid"] for r in rows}

    async def _cut(self, f: scenarios.Fault, cut: Cut) -> None:
        """Cut a member off from ``cut.services`` (its batch held at ``cut.hold`` first),
        wait for what the cut must bring about, heal, and time the member's way back."""
        child = await self.pick_owner(f.pick)
        cuts = self.cuts[self.slot_of(child)]
        o = self.scenario.options
        idle_timeout = o.idle_timeout_ms / 1000
        line = ""
        if cut.hold is not None:
            n = len(child.lines)
            child.send(f"hold {cut.hold}")
            _, line = await child.expect("FAILPOINT", after=n, within=HOLD_WITHIN)
            self.note(f"{child.name}: {line}")
        open_ = await self._in_transaction(child.name)
        owned = {p: (h, t) for p, (h, t, _) in (await self.owners()).items()}
        mine = {p for p, (h, _) in owned.items() if h == child.name}
        before = await self.offsets_of(None)
        if cut.answer_lost:
            cuts.proxies["postgres"].cut(to_service=False)
            child.send("release")
            await self._committed(child.name, line)
            cuts.reset("postgres")
            self.note(f"{child.name}'s COMMIT landed, its answer lost: connections reset")
        else:
            cuts.cut(*cut.services)
            if cut.hold in IN_TRANSACTION:
                child.send("release")  # its next statement goes into the cut
            self.note(
                f"{child.name} cut off from {' and '.join(cut.services)}, "
                f"{len(open_)} transaction(s) open"
            )
        t_cut = time.monotonic()
        if "kafka" in cut.services:
            # The group drops the member after its session timeout; another takes its
            # partitions (past the cut member's open transactions, if Postgres is cut too).
            bound = o.session_timeout_ms / 1000 + REBALANCE_SLACK
            if "postgres" in cut.services:
                bound = max(bound, idle_timeout + SESSION_END_SLACK)
            took = await self._taken_over(child.name, mine, before, bound)
            heal_at = time.monotonic() + f.wait
        else:
            took = await self._sessions_end(child.name, open_, idle_timeout)
            heal_at = t_cut + (0.0 if cut.answer_lost else idle_timeout) + f.wait
        if took is not None:
            self.figures.takeovers.append(took)
        if cut.hold == "before_begin":
            await self._settle(child, line)
        await asyncio.sleep(max(heal_at - time.monotonic(), 0.0))
        others = await self.offsets_of(None)
        marks = await self.marks()
        cuts.heal()
        t_heal = time.monotonic()
        self.note(f"{child.name} healed after {t_heal - t_cut:.1f}s")
        if "kafka" not in cut.services:
            stuck = [
                p
                for p, base in sorted(before.items())
                if p not in mine and self.acked[p] > (base or 0) and others.get(p) == base
            ]
            if stuck:
                self.violation(
                    f"partitions {stuck} of the other members did not move while {child.name} "
                    "was cut off from Postgres"
                )
        await self._back_to_work(child, t_heal, marks["batch"], {p: others[p] for p in mine})

    async def _sessions_end(
        self, holder: str, open_: set[int], idle_timeout: float
    ) -> float | None:
        """Seconds until the server ended ``holder``'s sessions ``open_`` (None: not within
        the idle timeout, a violation)."""
        t0 = time.monotonic()

        async def ended() -> bool:
            return not (open_ & await self._in_transaction(holder))

        try:
            await helpers.wait_for(
                ended,
                within=idle_timeout + SESSION_END_SLACK,
                interval=0.05,
                what=f"the server to end {holder}'s cut sessions",
            )
        except AssertionError:
            self.violation(
                f"{holder}'s transactions stayed open behind the cut past the idle "
                f"timeout ({idle_timeout:g}s + {SESSION_END_SLACK:g}s)"
            )
            return None
        took = time.monotonic() - t0
        self.note(f"the server ended {holder}'s sessions {took:.1f}s after the cut")
        return took

    async def _taken_over(
        self, holder: str, mine: set[int], before: dict[int, int | None], bound: float
    ) -> float | None:
        """Seconds until others hold ``holder``'s partitions ``mine`` and moved each past
        ``before`` (None: not within ``bound``, a violation)."""
        t0 = time.monotonic()

        async def taken() -> bool:
            now = await self.owners()
            return all(
                now[p][0] != holder and (n := now[p][2]) is not None and (b is None or n > b)
                for p in mine
                for b in [before[p]]
            )

        try:
            await helpers.wait_for(
                taken, within=bound, what=f"others to take {holder}'s partitions over"
            )
        except AssertionError:
            self.violation(f"{holder}'s partitions {sorted(mine)} not taken over in {bound:g}s")
            return None
        took = time.monotonic() - t0
        self.note(f"{holder}'s partitions {sorted(mine)} taken over {took:.1f}s after the cut")
        return took

    async def _settle(self, child: Child, failpoint: str) -> None:
        """Let ``child``'s turn held before its BEGIN go on, under the token it had: the
        fence refuses it (or, broken, it commits)."""
        token = int(failpoint.split()[-1])
        marks = await self.marks()
        child.send("release")

        async def settled() -> bool:
            return await self.settled(child.name, token, marks)

        try:
            await helpers.wait_for(settled, within=HOLD_WITHIN, what=f"{child.name}'s held turn")
        except AssertionError:
            self.note(f"{child.name}'s held turn left no trace (dropped by its owner look?)")
        else:
            self.note(f"{child.name}'s turn held since before the cut settled")

    async def _back_to_work(
        self, child: Child, t_heal: float, batch_mark: int, at_heal: dict[int, int | None]
    ) -> None:
        """Time the healed member's way back: it commits a batch again, and every partition
        it held moves past where it stood at the heal (or production is over and it is
        caught up)."""

        async def working() -> bool:
            committed = await self.q(
                lambda p: p.fetchval(
                    "SELECT EXISTS (SELECT FROM chaos_batches WHERE id > $1 AND holder = $2)",
                    batch_mark,
                    child.name,
                )
            )
            now = await self.offsets_of(None)
            return (committed or self.production_done.is_set()) and all(
                (n := now.get(p)) is not None
                and (
                    (base is None or n > base)
                    or (self.production_done.is_set() and n >= self.acked[p])
                )
                for p, base in at_heal.items()
            )

        try:
            await helpers.wait_for(
                working, within=driver.RECOVERY_WITHIN, what=f"{child.name} back to work"
            )
        except AssertionError:
            self.violation(
                f"{child.name} not back to work {driver.RECOVERY_WITHIN:g}s after the heal"
            )
            return
        took = time.monotonic() - t_heal
        self.figures.progress.append(took)
        self.result.recoveries.append(took)
        self.note(f"{child.name} back to work {took:.1f}s after the heal")
        if took > HEAL_BOUND:
            self.violation(
                f"{child.name} back to work {took:.1f}s after the heal, past {HEAL_BOUND:g}s"
            )


class TaskCutRun(driver.TaskRunRun):
    """Runners of one (task, key) at a time: the one that works is cut off from Postgres
    past its lease while another takes over, then healed."""

    def __init__(
        self,
        ctx: driver.RunContext,
        scenario: scenarios.Scenario,
        seed: int,
        matrix: str,
        broken: str | None = None,
    ) -> None:
        super().__init__(ctx, scenario, seed, matrix)
        self.result = Result(scenario.name, seed, matrix)
        self.result.broken = broken
        self.broken = broken
        self.proxies: list[proxy.Proxy] = []

    @property
    def figures(self) -> Result:
        assert isinstance(self.result, Result)
        return self.result

    async def lease_token(self, key: int) -> int | None:
        return await self.q(
            lambda p: p.fetchval(
                "SELECT token FROM dedup.leases WHERE resource = $1",
                f"task:{self.task}:{self.keys[key]}",
            )
        )

    async def cut_race(self, f: scenarios.Fault) -> None:
        """Runner A takes the key's lease and works (``task_cut_working``: on a long job;
        ``task_cut_writing``: its write and the task's completion held, then sent into the
        cut); A is cut off from Postgres; B, firing meanwhile, takes over once A's lease
        expired; A heals ``f.wait`` seconds after the takeover."""
        key, name = f.member, self.keys[f.member]
        writing = f.kind == "task_cut_writing"
        cut = await proxy.Proxy(f"a{key}/postgres", pg_port(self.ctx.dsn)).start()
        self.proxies.append(cut)
        a = await self.runner(
            key,
            f"a{key}",
            dsn=proxy.with_port(self.ctx.dsn, cut.port),
            work=self.work[key] if writing else TASK_LONG_JOB,
            held=writing,
            env={"CHAOS_BREAK": self.broken} if self.broken else None,
        )
        _, line = await a.expect("WRITING" if writing else "WORKING", within=HOLD_WITHIN)
        token = int(line.split()[1])
        b = await self.runner(key, f"b{key}")
        cut.cut()
        t_cut = time.monotonic()
        if writing:
            a.send("release")  # its completion goes into the cut
        self.note(f"{name}: a{key} (token {token}) cut off from Postgres while {line.split()[0]}")

        async def taken_over() -> bool:
            return (await self.lease_token(key) or 0) > token

        bound = driver.TASK_TTL + TASK_TAKEOVER_SLACK
        try:
            await helpers.wait_for(taken_over, within=bound, what=f"{name} taken over")
        except AssertionError:
            self.violation(f"{name}: a{key}'s lease not taken over within {bound:g}s of the cut")
        else:
            took = time.monotonic() - t_cut
            self.figures.takeovers.append(took)
            self.note(f"{name}: b{key} took the lease over {took:.1f}s after the cut")
        heal_at = time.monotonic() + f.wait
        told = driver.TASK_TTL + TASK_TOLD_SLACK
        try:
            await a.expect("LOST", within=max(t_cut + told - time.monotonic(), 0.0))
        except AssertionError:
            self.violation(
                f"{name}: a{key}'s job not told it lost its lease within {told:g}s of the cut"
            )
        else:
            took = time.monotonic() - t_cut
            self.figures.told.append(took)
            self.note(f"{name}: a{key} told it lost the lease {took:.1f}s after the cut")
        await asyncio.sleep(max(heal_at - time.monotonic(), 0.0))
        cut.heal()
        t_heal = time.monotonic()
        self.note(f"{name}: a{key} healed after {t_heal - t_cut:.1f}s")
        try:
            code = await a.wait(within=HEAL_BOUND)
        except AssertionError:
            self.violation(f"{name}: a{key} still running {HEAL_BOUND:g}s after the heal")
            a.struck = True
            await a.kill()
        else:
            took = time.monotonic() - t_heal
            self.figures.progress.append(took)
            self.result.recoveries.append(took)
            self.note(f"{name}: a{key} exited with {code} {took:.1f}s after the heal")
        await b.wait(within=driver.RECOVERY_WITHIN)
        self.result.faults += 1

    async def execute(self) -> report.Result:
        self.note(f"{self.scenario.name} seed {self.seed} ({self.matrix}): {len(self.keys)} keys")
        for f in self.faults:
            self.note(f"scheduled: {f.describe()} key={self.keys[f.member]}")
        self.pool = await asyncpg.create_pool(self.ctx.dsn, min_size=0, max_size=3)
        for f in self.faults:
            await self.cut_race(f)
        self.check_exits()
        self.result.messages = sum(
            1 for c in self.children for line in c.lines if line.startswith("OUTCOME")
        )
        async with self.pool.acquire() as conn:
            verdict = await oracle.check_task_run(conn, self.task, self.keys, None)
        r = self.result
        r.lost, r.doubled = verdict.lost, verdict.doubled
        r.stale_refused, r.stale_committed = verdict.stale_refused, verdict.stale_committed
        r.violations.extend(verdict.violations)
        return self.finish()

    async def close(self) -> None:
        for p in self.proxies:
            p.heal()
        await super().close()
        for p in self.proxies:
            await p.close()


async def run(
    ctx: driver.RunContext,
    name: str,
    seed: int,
    *,
    matrix: str | None = None,
    broken: str | None = None,
) -> Result:
    """Run one partition scenario with one seed; the result carries the oracle's findings."""
    matrix = matrix or scenarios.matrix()
    scenario = SCENARIOS[name]
    the_run: driver.Run
    if scenario.tasks:
        the_run = TaskCutRun(ctx, scenario, seed, matrix, broken)
    else:
        the_run = NetsplitRun(ctx, scenario, seed, matrix, broken)
    result = await driver.conclude(the_run, matrix)
    assert isinstance(result, Result)
    return result


# ------------------------------------------------------------------ table --


def table(results: list[report.Result]) -> str:
    """One Markdown row per partition scenario, summed over its runs (seeds)."""
    by: dict[str, list[Result]] = {}
    for r in results:
        assert isinstance(r, Result)
        by.setdefault(r.scenario, []).append(r)
    rows = [
        "| scenario | runs (seeds) | messages | faults | lost | doubled | dead-lettered "
        "| stale writes refused | stale writes committed | cut → takeover, worst "
        "| cut → told the lease is lost, worst | heal → progress, median "
        "| heal → progress, worst |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]

    def seconds(values: list[float], pick: Callable[[list[float]], float]) -> str:
        return f"{pick(values):.1f} s" if values else "-"

    for name, runs in by.items():
        takeovers = [x for r in runs for x in r.takeovers]
        told = [x for r in runs for x in r.told]
        progress = [x for r in runs for x in r.progress]
        rows.append(
            f"| {name} | {len(runs)} ({', '.join(str(r.seed) for r in runs)})"
            f" | {sum(r.messages for r in runs)} | {sum(r.faults for r in runs)}"
            f" | {sum(r.lost for r in runs)} | {sum(r.doubled for r in runs)}"
            f" | {sum(r.dead_lettered for r in runs)} | {sum(r.stale_refused for r in runs)}"
            f" | {sum(r.stale_committed for r in runs)} | {seconds(takeovers, max)}"
            f" | {seconds(told, max)} | {seconds(progress, statistics.median)}"
            f" | {seconds(progress, max)} |"
        )
    return "\n".join(rows)


def summary(terminalreporter: Any) -> None:
    """The partition runs' table: on the terminal, next to the chaos report, in the docs."""
    report.summarize(
        terminalreporter,
        list(RESULTS),
        title="network partitions",
        suffix="partitions",
        render=table,
        start=TABLE_START,
        end=TABLE_END,
    )
