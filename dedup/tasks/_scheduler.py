"""Cron schedules fired once per period across any number of machines.

A schedule (a row of ``schedules``) names a cron line in a time zone, a task
code and its job.  Every :class:`Scheduler` polls the schedules; one
decision round, in one transaction on the database's clock:

1. lock the schedules that are not paused (``FOR UPDATE SKIP LOCKED``: a
   schedule another scheduler is deciding right now is its to decide);
2. for each, :func:`dedup.tasks._periods.decide` which due periods fire,
   which are skipped (catch-up, overlap) and which waits (``buffer_one``);
3. move the schedule's ``decided_until`` past them, create their ``tasks``
   rows (``pending``) and write the ``schedule_*`` events.

After the commit the scheduler runs each fired period's business key through
its :class:`dedup.TaskRunner`, oldest first, so a period runs once even when
two schedulers decide at once.  A period decided but never started (its
scheduler died between the two) and a run whose holder stopped renewing are
run again by the next decision round.  A failed run is left to the task's own
rules: ``dedup task run`` or a backfill retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import asyncpg

from dedup import _errors as errors
from dedup import _imports as imports
from dedup import _leases as leases
from dedup import _limits as limits
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql
from dedup.operations import _task_stats as task_stats
from dedup.tasks import _periods as periods
from dedup.tasks import _run as task_run
from dedup.tasks import _runner as runner

log = logging.getLogger("dedup.scheduler")

DEFAULT_POLL_INTERVAL = 5.0
"""Seconds between decision rounds when no period is due sooner (a paused schedule resumed,
a schedule added elsewhere, a run to pick up are seen within it)."""
DEFAULT_CATCH_UP_WINDOW = datetime.timedelta(days=7)
"""How far back a scheduler catches up missed periods (``catch_up`` ``all`` and ``latest``)."""
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
"""Seconds :meth:`Scheduler.stop` waits for running jobs before it cancels them."""
ABANDONED_PER_ROUND = 100
"""At most this many abandoned periods of one schedule are picked up per round, so a round's
transaction (which holds the schedule's row lock) stays short; the rest wait for the next."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One schedule as stored: what :meth:`Scheduler.list` returns."""

    name: str
    task: str
    job: str
    """The job as ``MODULE:FUNCTION``."""
    cron: periods.Cron
    key_format: str
    """How a period's time (in the schedule's zone) becomes the business key (strftime)."""
    catch_up: periods.CatchUp
    catch_up_window: datetime.timedelta
    overlap: periods.Overlap
    lease_ttl: float
    platform_timeout: float | None
    """The platform's timeout of a run, as declared (seconds), or None."""
    paused: bool
    decided_until: datetime.datetime
    """Every period up to this time is decided."""
    buffered: datetime.datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Schedule:
        return cls(
            name=row["name"],
            task=row["task"],
            job=row["job"],
            cron=periods.Cron(row["cron"], row["timezone"]),
            key_format=row["key_format"],
            catch_up=row["catch_up"],
            catch_up_window=datetime.timedelta(seconds=row["catch_up_window"]),
            overlap=row["overlap"],
            lease_ttl=row["lease_ttl"],
            platform_timeout=row["platform_timeout"],
            paused=row["paused"],
            decided_until=row["decided_until"],
            buffered=row["buffered"],
        )

    def key(self, period: datetime.datetime) -> str:
        """The business key of ``period``."""
        return periods.business_key(period.astimezone(self.cron.zone), self.key_format)

    def next_due(self) -> datetime.datetime:
        """When its next undecided period comes due."""
        return self.cron.after(self.decided_until)


class Scheduler:
    """Fires cron schedules once per period, however many schedulers run.

    Give it ``dsn`` (or an asyncpg ``pool``).  :meth:`add`, :meth:`pause`,
    :meth:`resume`, :meth:`remove` and :meth:`backfill` change the schedules
    in Postgres, for every scheduler; :meth:`run` decides and runs due periods
    until :meth:`stop`.  ``holder`` names this scheduler in leases and events;
    ``poll_interval`` (seconds) bounds how long a change made elsewhere goes
    unseen; ``max_attempts`` goes to the :class:`dedup.TaskRunner` that runs the jobs.
    """

    def __init__(
        self,
        *,
        dsn: str | None = None,
        pool: Any = None,
        holder: str | None = None,
        schema: str = sql.DEFAULT_SCHEMA,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        max_attempts: int = runner.DEFAULT_MAX_ATTEMPTS,
        pool_options: Mapping[str, Any] | None = None,
    ) -> None:
        db.require_one(dsn, pool)
        limits.check_number("poll_interval", poll_interval, 0.01, 3600, whole=False)
        limits.check_number("shutdown_timeout", shutdown_timeout, 0, 86400, whole=False)
        self.holder = limits.check_text(
            "holder", holder or leases.default_holder(), limits.MAX_NAME_BYTES
        )
        """This scheduler's name in leases and events."""
        self.schema = schema
        self.poll_interval = poll_interval
        self.shutdown_timeout = shutdown_timeout
        self._runner = runner.TaskRunner(
            dsn=dsn,
            pool=pool,
            holder=self.holder,
            schema=schema,
            max_attempts=max_attempts,
            pool_options=pool_options,
        )
        self._dsn = dsn
        self._pool = pool
        self._pool_options = db.check_pool_options(pool_options, pool=pool)
        self._settings: Mapping[str, str] = db.TRANSACTION_SETTINGS if pool is None else {}
        self._q = sql.Queries(schema)
        self._jobs: dict[str, runner.Job] = {}
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()
        self._refused: set[str] = set()
        self._schema_checked = False

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection in a transaction: from the pool :meth:`run` holds, or a short-lived one."""
        options = {"min_size": 1, "max_size": 1, **self._pool_options}
        async with (
            db.pool_for(self._dsn, self._pool, **options) as pool,
            pool.acquire() as conn,
            db.transaction(conn, self._settings),
        ):
            yield conn

    async def _check_schema(self, conn: asyncpg.Connection) -> None:
        """Refuse a schema that lacks a migration this dedup needs (once per scheduler)."""
        if not self._schema_checked:
            await migrations.check(conn, schema=self.schema)
            self._schema_checked = True

    # --- the schedules ------------------------------------------------------------

    async def add(
        self,
        name: str,
        *,
        cron: str,
        task: str,
        job: runner.Job | str,
        timezone: str = "UTC",
        key_format: str = "%Y-%m-%d",
        catch_up: periods.CatchUp = "all",
        catch_up_window: datetime.timedelta = DEFAULT_CATCH_UP_WINDOW,
        overlap: periods.Overlap = "skip",
        lease_ttl: float = runner.DEFAULT_LEASE_TTL,
        platform_timeout: float | None = None,
        start: datetime.datetime | None = None,
    ) -> Literal["added", "changed", "unchanged"]:
        """Create schedule ``name``, or change it to this definition; says which it did.

        ``job`` is an async function (this scheduler runs it; other schedulers
        import it as ``MODULE:FUNCTION``) or that text.  A new schedule fires
        the periods after now, or from ``start`` (a past ``start`` makes the
        periods since then missed: they go by ``catch_up``).  A changed cron or
        time zone starts again from now; other changes keep the schedule's place.
        """
        limits.check_text("schedule name", name, limits.MAX_NAME_BYTES)
        periods.Cron(cron, timezone)
        runner.check_task(task)
        spec = job if isinstance(job, str) else _spec_of(job)
        if not isinstance(job, str):
            self._jobs[name] = job
        if catch_up not in periods.CATCH_UPS:
            raise errors.ConfigurationError(
                f"catch_up must be one of {', '.join(periods.CATCH_UPS)}, not {catch_up!r}"
            )
        if overlap not in periods.OVERLAPS:
            raise errors.ConfigurationError(
                f"overlap must be one of {', '.join(periods.OVERLAPS)}, not {overlap!r}"
            )
        _check_key_format(key_format)
        limits.check_number(
            "lease_ttl", lease_ttl, runner.MIN_TASK_LEASE_TTL, limits.MAX_LEASE_TTL, whole=False
        )
        if platform_timeout is not None:
            limits.check_number("platform_timeout", platform_timeout, 1, 7 * 86400, whole=False)
        if start is not None and start.tzinfo is None:
            raise errors.ConfigurationError(f"start {start} needs a time zone")
        async with self._connection() as conn:
            await self._check_schema(conn)
            created: bool | None = await self._q.schedule_upsert.fetchval(
                conn,
                name=name,
                task=task,
                job=spec,
                cron=cron,
                timezone=timezone,
                key_format=key_format,
                catch_up=catch_up,
                catch_up_window=catch_up_window.total_seconds(),
                overlap=overlap,
                lease_ttl=float(lease_ttl),
                platform_timeout=None if platform_timeout is None else float(platform_timeout),
                decided_until=None if start is None else start - datetime.timedelta(microseconds=1),
            )
            if created is None:
                return "unchanged"
            kind = "schedule_added" if created else "schedule_changed"
            await events.record(conn, self.schema, [self._event(name, kind, cron=cron)])
        return "added" if created else "changed"

    async def schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        async with self._connection() as conn:
            rows = await self._q.schedule_list.fetch(conn)
        return [Schedule.from_row(row) for row in rows]

    async def get(self, name: str) -> Schedule:
        """Schedule ``name``; a ConfigurationError if there is none."""
        async with self._connection() as conn:
            row = await self._q.schedule_get.fetchrow(conn, name=name)
        if row is None:
            raise errors.ConfigurationError(f"no schedule named {name!r}")
        return Schedule.from_row(row)

    async def pause(self, name: str) -> None:
        """Stop firing ``name``; periods that pass meanwhile are missed (see :meth:`resume`)."""
        await self._set_paused(name, True)

    async def resume(self, name: str) -> None:
        """Fire ``name`` again; the periods missed while paused go by its ``catch_up``."""
        await self._set_paused(name, False)

    async def _set_paused(self, name: str, paused: bool) -> None:
        async with self._connection() as conn:
            if await self._q.schedule_set_paused.fetchval(conn, name=name, paused=paused) is None:
                raise errors.ConfigurationError(f"no schedule named {name!r}")
            kind = "schedule_paused" if paused else "schedule_resumed"
            await events.record(conn, self.schema, [self._event(name, kind)])

    async def remove(self, name: str) -> None:
        """Delete schedule ``name`` (its tasks and events stay)."""
        async with self._connection() as conn:
            if await self._q.schedule_remove.fetchval(conn, name=name) is None:
                raise errors.ConfigurationError(f"no schedule named {name!r}")
            await events.record(conn, self.schema, [self._event(name, "schedule_removed")])

    async def backfill(
        self, name: str, first: datetime.date, last: datetime.date, *, force: bool = False
    ) -> list[task_run.TaskOutcome]:
        """Run each period of ``name`` from day ``first`` to day ``last`` (its zone), in order.

        One run per business key, through the task runner: a period that
        already succeeded is skipped unless ``force`` (a forced run is audited
        in its ``task_started`` event).  Returns each run's outcome.
        """
        if last < first:
            raise errors.ConfigurationError(f"backfill to {last} is before its start {first}")
        schedule = await self.get(name)
        job = self._job(schedule)
        zone = schedule.cron.zone
        after = datetime.datetime.combine(first, datetime.time(), zone)
        until = datetime.datetime.combine(last + datetime.timedelta(days=1), datetime.time(), zone)
        due = schedule.cron.between(after - datetime.timedelta(microseconds=1), until, limit=10**6)
        keys = list(dict.fromkeys(schedule.key(p) for p in due if p < until))
        async with self._connection() as conn:
            event = self._event(
                name, "schedule_backfill", first=first, last=last, periods=len(keys), forced=force
            )
            await events.record(conn, self.schema, [event])
        # Not inside `async with self._runner`: run() may hold it open meanwhile.
        return [
            await self._runner.run(
                schedule.task, key, job, lease_ttl=schedule.lease_ttl, force=force
            )
            for key in keys
        ]

    # --- the scheduler ------------------------------------------------------------

    async def run(self) -> None:
        """Decide and run due periods until :meth:`stop`; then let running jobs end."""
        self._stopping.clear()
        opened = None
        if self._pool is None:
            assert self._dsn is not None  # noqa: S101 (require_one was called)
            options = {"min_size": 1, "max_size": 2, **self._pool_options}
            self._pool = opened = await db.create_pool(self._dsn, **options)
        try:
            async with self._runner:
                try:
                    while not self._stopping.is_set():
                        wait = await self.decide()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._stopping.wait(), timeout=wait)
                finally:
                    await self._drain()
        finally:
            if opened is not None:
                self._pool = None
                await opened.close()

    async def stop(self) -> None:
        """Make :meth:`run` return once its jobs end (cancelled after ``shutdown_timeout``)."""
        self._stopping.set()

    async def _drain(self) -> None:
        running = list(self._running.values())
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=self.shutdown_timeout)
        for job in late:
            job.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def decide(self) -> float:
        """One decision round (see the module); returns the seconds until the next is due."""
        fired: list[tuple[Schedule, runner.Job, list[str]]] = []
        wait = self.poll_interval
        async with self._connection() as conn:
            await self._check_schema(conn)
            rows = await self._q.schedule_lock_active.fetch(conn)
            for row in rows:
                schedule = Schedule.from_row(row)
                job = self._loadable(schedule)
                if job is None:
                    continue
                now = row["now"]
                keys = await self._decide_one(conn, schedule, now)
                if keys:
                    fired.append((schedule, job, keys))
                next_due = schedule.cron.after(max(now, schedule.decided_until))
                wait = min(wait, (next_due - now).total_seconds())
        for schedule, job, keys in fired:
            self._start(schedule, job, keys)
        return max(wait, 0.0)

    async def _decide_one(
        self, conn: asyncpg.Connection, schedule: Schedule, now: datetime.datetime
    ) -> list[str]:
        """Decide ``schedule``'s due periods; the business keys to run now, in order."""
        running = await self._q.schedule_running.fetchval(conn, task=schedule.task)
        decision = periods.decide(
            schedule.cron,
            now=now,
            decided_until=schedule.decided_until,
            catch_up=schedule.catch_up,
            window=schedule.catch_up_window,
            overlap=schedule.overlap,
            running=running,
            buffered=schedule.buffered,
        )
        await self._q.schedule_decided.execute(
            conn,
            name=schedule.name,
            decided_until=decision.decided_until,
            buffered=decision.buffered,
        )
        found: list[events.Event] = []
        keys: list[str] = []
        for period in decision.fire:
            key = schedule.key(period)
            await self._q.task_ensure.execute(conn, task=schedule.task, business_key=key)
            found.append(self._event(schedule.name, "schedule_fired", key, period=period))
            keys.append(key)
        for skipped in decision.skipped:
            first, last = skipped.periods[0], skipped.periods[-1]
            found.append(
                self._event(
                    schedule.name,
                    "schedule_skipped",
                    schedule.key(first),
                    reason=skipped.reason,
                    periods=len(skipped.periods),
                    first=first,
                    last=last,
                )
            )
        if decision.buffered is not None and decision.buffered != schedule.buffered:
            found.append(
                self._event(
                    schedule.name,
                    "schedule_buffered",
                    schedule.key(decision.buffered),
                    period=decision.buffered,
                )
            )
        if decision.fire and schedule.platform_timeout is not None:
            found += await self._timeout_warning(conn, schedule, len(decision.fire))
        await events.record(conn, self.schema, found)
        abandoned = await self._q.schedule_abandoned.fetch(
            conn,
            task=schedule.task,
            grace=periods.ON_TIME.total_seconds(),
            limit=ABANDONED_PER_ROUND,
        )
        keys += [
            row["business_key"]
            for row in abandoned
            if row["business_key"] not in keys
            and (schedule.task, row["business_key"]) not in self._running
        ]
        return keys

    async def _timeout_warning(
        self, conn: asyncpg.Connection, schedule: Schedule, runs: int
    ) -> list[events.Event]:
        """The warning of runs fired under a platform timeout shorter than the task's p95."""
        p95 = await task_stats.p95(conn, schedule.task, self.schema)
        timeout = schedule.platform_timeout
        if p95 is None or timeout is None or timeout >= p95:
            return []
        telemetry.timeouts_too_short.add(runs, {"dedup.task": schedule.task})
        log.warning(
            "schedule %s: the platform timeout %.1f s is under task %s's p95 duration %.1f s",
            schedule.name,
            timeout,
            schedule.task,
            p95,
        )
        return [
            self._event(
                schedule.name, "schedule_timeout_too_short", platform_timeout=timeout, p95=p95
            )
        ]

    def _start(self, schedule: Schedule, job: runner.Job, keys: list[str]) -> None:
        """Run ``keys`` one after another in the background (the next after the last ended)."""
        keys = [k for k in keys if (schedule.task, k) not in self._running]
        if not keys:
            return
        chain = asyncio.ensure_future(self._run_keys(schedule, job, keys))
        for key in keys:
            self._running[(schedule.task, key)] = chain

    async def _run_keys(self, schedule: Schedule, job: runner.Job, keys: list[str]) -> None:
        try:
            for key in keys:
                try:
                    await self._runner.run(schedule.task, key, job, lease_ttl=schedule.lease_ttl)
                except (errors.ServiceUnavailableError, errors.ConfigurationError):
                    # Its task row stays pending (or running): a later round runs it again.
                    log.exception(
                        "schedule %s: %s %s did not run", schedule.name, schedule.task, key
                    )
                finally:
                    self._running.pop((schedule.task, key), None)
        finally:
            for key in keys:
                self._running.pop((schedule.task, key), None)

    def _job(self, schedule: Schedule) -> runner.Job:
        job = self._jobs.get(schedule.name)
        if job is None:
            job = imports.load(
                schedule.job, what="job", expected="async def job(run: dedup.TaskRun)"
            )
            self._jobs[schedule.name] = job
        return job

    def _loadable(self, schedule: Schedule) -> runner.Job | None:
        """The schedule's job, or None (said once) if this scheduler can't import it."""
        try:
            return self._job(schedule)
        except errors.ConfigurationError as exc:
            if schedule.name not in self._refused:
                self._refused.add(schedule.name)
                log.warning("schedule %s left to other schedulers: %s", schedule.name, exc)
            return None

    def _event(self, name: str, kind: str, key: str | None = None, **detail: Any) -> events.Event:
        return events.Event(
            subject="schedule",
            kind=kind,
            namespace=name,
            key=key,
            holder=self.holder,
            detail={
                k: v.isoformat() if isinstance(v, datetime.date) else v for k, v in detail.items()
            },
        )


def _spec_of(job: runner.Job) -> str:
    """``MODULE:QUALNAME`` of an async function, for schedulers that import it."""
    module, qualname = getattr(job, "__module__", None), getattr(job, "__qualname__", "")
    if not callable(job) or not module or "<" in qualname:
        raise errors.ConfigurationError(
            f"job {job!r}: pass an async function defined at a module's top level "
            "(other schedulers import it as MODULE:FUNCTION), or that text"
        )
    return f"{module}:{qualname}"


def _check_key_format(key_format: str) -> None:
    probe = datetime.datetime(2001, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)
    if not isinstance(key_format, str) or "%" not in key_format:
        raise errors.ConfigurationError(
            f"key_format {key_format!r} would give every period the same business key: "
            "use strftime codes, e.g. %Y-%m-%d"
        )
    limits.check_text("business key", probe.strftime(key_format), limits.MAX_BUSINESS_KEY_BYTES)
