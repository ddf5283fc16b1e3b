"""How long a task's runs take, against its lease and its platform's timeout (``dedup task stats``).

Every run that ends writes its duration (database time, start to success or
failure) in its ``task_succeeded`` or ``task_failed`` event, and every start
its lease ttl.  :func:`task_stats` reads the successful runs of a window:
p50, p95 and the longest, the ttl of the latest run and how often it is
renewed, and the platform timeouts the task's schedules declare (or one given).

It warns when a platform timeout is under the p95 duration: the platform
stops (and may fire again) most runs before they end, and a rerun repeats
the work that was not in a completed step.  And it warns when the lease ttl
is under 1.5 x the p95 (:data:`LEASE_MARGIN`): the watchdog renews the lease
on the job's event loop, so a job that blocks the loop (CPU-bound work, a
synchronous driver) or a process that is paused renews nothing, and a lease
shorter than the usual run then expires under it and lets a second holder in.
A run that starts with such a lease writes ``task_lease_too_short`` and counts
``dedup.task.leases_too_short`` (the task runner, with :func:`p95` and
:func:`lease_too_short`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import asyncpg

from dedup.data import _sql as sql

DEFAULT_WINDOW = dt.timedelta(days=30)
"""The runs ``dedup task stats`` reads by default: those of the last 30 days."""
DEFAULT_RUNS = 100
"""Of those, the latest 100 successful runs: a run's start reads no more."""
LEASE_MARGIN = 1.5
"""A lease should outlast 1.5 x the p95 run without one renewal (the field's rule of thumb:
1.5 to 2 x the usual duration): a loop that stops renewing then still ends its run.  The
same margin is the platform timeout the warning asks for."""


@dataclasses.dataclass(frozen=True)
class TaskStats:
    """The durations of one task's successful runs, and what they are measured against."""

    task: str
    runs: int
    """Successful runs in the window."""
    p50: float | None
    p95: float | None
    longest: float | None
    lease_ttl: float | None
    """The ttl of the latest run's lease, seconds (None: never run)."""
    renew_every: float | None
    """How often the watchdog renews it, seconds."""
    timeouts: tuple[tuple[str, float], ...]
    """(where it is declared, seconds): ``--timeout``, or each schedule's platform timeout."""

    @property
    def warnings(self) -> list[str]:
        """What is wrong, one sentence each (empty: nothing)."""
        if self.p95 is None:
            return []
        found = []
        if self.lease_ttl is not None and lease_too_short(self.lease_ttl, self.p95):
            found.append(
                f"lease ttl {_s(self.lease_ttl)} is under {LEASE_MARGIN} x the p95 duration "
                f"{_s(self.p95)}: a run whose loop stops renewing (a blocking job, a paused "
                f"process) loses it before it usually ends; raise it to at least "
                f"{_s(LEASE_MARGIN * self.p95)}"
            )
        return found + [
            f"platform timeout {_s(seconds)} ({origin}) is under the p95 duration "
            f"{_s(self.p95)}: the platform stops most long runs before they end; "
            f"raise it to at least {_s(LEASE_MARGIN * self.p95)} ({LEASE_MARGIN} x p95)"
            for origin, seconds in self.timeouts
            if seconds < self.p95
        ]

    def as_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "runs": self.runs,
            "duration": {"p50": self.p50, "p95": self.p95, "max": self.longest},
            "lease_ttl": self.lease_ttl,
            "renew_every": self.renew_every,
            "timeouts": [{"declared_by": o, "seconds": s} for o, s in self.timeouts],
            "warnings": self.warnings,
        }

    def lines(self) -> list[str]:
        """The report, as ``dedup task stats`` prints it."""
        if not self.runs:
            found = [f"task {self.task}: no successful run in the window"]
        else:
            found = [
                f"task {self.task}: {self.runs} successful runs; duration p50 {_s(self.p50)}, "
                f"p95 {_s(self.p95)}, max {_s(self.longest)}"
            ]
        if self.lease_ttl is not None:
            found.append(
                f"lease ttl {_s(self.lease_ttl)}, renewed every {_s(self.renew_every)} while "
                "a run lasts"
            )
        found += [f"platform timeout {_s(s)} ({o})" for o, s in self.timeouts]
        return found + [f"warning: {w}" for w in self.warnings]


async def task_stats(
    conn: asyncpg.Connection,
    task: str,
    *,
    schema: str = sql.DEFAULT_SCHEMA,
    window: dt.timedelta = DEFAULT_WINDOW,
    runs: int = DEFAULT_RUNS,
    platform_timeout: float | None = None,
) -> TaskStats:
    """The :class:`TaskStats` of ``task``'s latest ``runs`` successful runs in the last ``window``.

    ``platform_timeout`` is the platform's timeout of a run (seconds); without it, each schedule
    of the task that declares one (``--timeout`` of ``dedup schedule add``).
    """
    q = sql.Queries(schema)
    row = await q.task_durations.fetchrow(conn, task=task, since=window.total_seconds(), runs=runs)
    lease = await q.task_last_lease.fetchrow(conn, task=task)
    if platform_timeout is not None:
        timeouts: tuple[tuple[str, float], ...] = (("--timeout", platform_timeout),)
    else:
        declared = await q.task_platform_timeouts.fetch(conn, task=task)
        timeouts = tuple((f"schedule {r['name']}", r["platform_timeout"]) for r in declared)
    return TaskStats(
        task=task,
        runs=row["runs"],
        p50=row["p50"],
        p95=row["p95"],
        longest=row["max"],
        lease_ttl=None if lease is None else lease["lease_ttl"],
        renew_every=None if lease is None else lease["renew_every"],
        timeouts=timeouts,
    )


def lease_too_short(ttl: float, p95: float | None) -> bool:
    """A lease of ``ttl`` seconds is under :data:`LEASE_MARGIN` x the runs' ``p95``."""
    return p95 is not None and ttl < LEASE_MARGIN * p95


async def p95(conn: asyncpg.Connection, task: str, schema: str) -> float | None:
    """The p95 duration of ``task``'s latest successful runs, as ``dedup task stats`` reads it."""
    row = await sql.Queries(schema).task_durations.fetchrow(
        conn, task=task, since=DEFAULT_WINDOW.total_seconds(), runs=DEFAULT_RUNS
    )
    found: float | None = row["p95"]
    return found


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"
