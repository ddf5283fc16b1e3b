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

A Postgres cut lasts the server's idle-in-transaction timeout of the member's
transactions (``handler_timeout`` + ``IDLE_MARGIN``) and ``Fault.wait``
seconds more, then heals: what the proxy held is delivered, the COMMIT too
(after the server ended that session, it is gone with it).

Figures of each fault, in the run's :class:`Result`:

- **cut → takeover**: for a Postgres cut, until the server has ended every
  session the member had in a transaction at the cut (its locks are free);
- **heal → progress**: until every partition the member owned moves its
  stored offset forward again (or, once production is over, is caught up).

Each fault also checks that the member's partitions stayed its own through
the cut and that the other members' partitions went on meanwhile.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dedup_dev import helpers, proxy
from dedup_dev.children import Child
from tests.chaos import driver, report, scenarios
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


def pg_cut_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    """Postgres cuts of a member mid-transaction, before its COMMIT or inside its handler;
    ``wait``: how long each lasts past the server's idle-in-transaction timeout."""
    kinds = scenarios._balanced(rng, ["pg_cut_before_commit", "pg_cut_in_handler"], size.faults)
    return [
        scenarios.Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.5, 2.0))
        for at, kind in zip(scenarios._spread(rng, size.faults, 1.0, 2.0), kinds, strict=True)
    ]


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
                "short": scenarios.Size(messages=300, faults=2, rate=80),
                "full": scenarios.Size(
                    messages=1200, faults=4, partitions=4, consumers=3, rate=100
                ),
            },
            pg_cut_schedule,
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

    def line(self) -> str:
        def worst(values: list[float]) -> str:
            return f"{max(values):.1f}s" if values else "-"

        return (
            f"{super().line()} cut-to-takeover={worst(self.takeovers)}"
            f" heal-to-progress={worst(self.progress)}"
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
        if f.kind in ("pg_cut_before_commit", "pg_cut_in_handler"):
            await self._pg_cut(f, f.kind.removeprefix("pg_cut_"))
        else:
            await super().inject_other(f)

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

    async def _pg_cut(self, f: scenarios.Fault, where: str) -> None:
        """Cut a member off from Postgres with a batch held at ``where``; heal after the
        server's idle timeout and ``f.wait`` more."""
        child = await self.pick_owner(f.pick)
        cuts = self.cuts[self.slot_of(child)]
        n = len(child.lines)
        child.send(f"hold {where}")
        _, line = await child.expect("FAILPOINT", after=n, within=HOLD_WITHIN)
        self.note(f"{child.name}: {line}")
        open_ = await self._in_transaction(child.name)
        owned = {p: (h, t) for p, (h, t, _) in (await self.owners()).items()}
        mine = {p for p, (h, _) in owned.items() if h == child.name}
        before = await self.offsets_of(None)
        cuts.cut("postgres")
        t_cut = time.monotonic()
        child.send("release")
        self.note(f"{child.name} cut off from Postgres, {len(open_)} transaction(s) open")
        idle_timeout = self.scenario.options.idle_timeout_ms / 1000
        heal_at = t_cut + idle_timeout + f.wait

        async def ended() -> bool:
            return not (open_ & await self._in_transaction(child.name))

        bound = idle_timeout + SESSION_END_SLACK
        try:
            await helpers.wait_for(
                ended,
                within=min(heal_at, t_cut + bound) - time.monotonic(),
                interval=0.05,
                what=f"the server to end {child.name}'s cut sessions",
            )
        except AssertionError:
            self.violation(
                f"{child.name}'s transactions stayed open behind the cut past the idle "
                f"timeout ({idle_timeout:g}s + {SESSION_END_SLACK:g}s)"
            )
        else:
            took = time.monotonic() - t_cut
            self.figures.takeovers.append(took)
            self.note(f"the server ended {child.name}'s sessions {took:.1f}s after the cut")
        await asyncio.sleep(max(heal_at - time.monotonic(), 0.0))
        during = await self.owners()
        others = await self.offsets_of(None)
        cuts.heal("postgres")
        t_heal = time.monotonic()
        self.note(f"{child.name} healed after {t_heal - t_cut:.1f}s")
        moved = [p for p in mine if during[p][:2] != owned[p]]
        if moved:
            self.note(f"partitions {moved} of {child.name} changed hands during the cut")
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
        affected = {p: before[p] for p in mine}
        self.watch(f"heal of {child.name}", t_heal, affected)
        if self.recovering is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.recovering), driver.RECOVERY_WITHIN)
            except TimeoutError:
                return  # inject() names it
            took = self.result.recoveries[-1]
            self.figures.progress.append(took)
            if took > HEAL_BOUND:
                self.violation(
                    f"{child.name}'s partitions moved again {took:.1f}s after the heal, past "
                    f"{HEAL_BOUND:g}s"
                )


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
    the_run = NetsplitRun(ctx, SCENARIOS[name], seed, matrix, broken)
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
        "| heal → progress, median | heal → progress, worst |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def seconds(values: list[float], pick: Callable[[list[float]], float]) -> str:
        return f"{pick(values):.1f} s" if values else "-"

    for name, runs in by.items():
        takeovers = [x for r in runs for x in r.takeovers]
        progress = [x for r in runs for x in r.progress]
        rows.append(
            f"| {name} | {len(runs)} ({', '.join(str(r.seed) for r in runs)})"
            f" | {sum(r.messages for r in runs)} | {sum(r.faults for r in runs)}"
            f" | {sum(r.lost for r in runs)} | {sum(r.doubled for r in runs)}"
            f" | {sum(r.dead_lettered for r in runs)} | {sum(r.stale_refused for r in runs)}"
            f" | {sum(r.stale_committed for r in runs)} | {seconds(takeovers, max)}"
            f" | {seconds(progress, statistics.median)} | {seconds(progress, max)} |"
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
