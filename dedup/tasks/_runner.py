"""Run-once tasks: a job runs once per (task code, business key), however often it is fired.

The same cron line on N machines, a redelivered timed-out job and an operator's
manual rerun all end up in :meth:`TaskRunner.run`.  Each (task, business key)
has one row in ``tasks`` with the state machine::

    pending ──► running ──► succeeded        (a rerun is skipped unless forced)
                   │  ▲
                   ▼  │ retry (attempts + 1, up to max_attempts)
                 failed

and one lease (resource ``task:<task>:<business key>``) whose fencing token
orders the runs.  Runners of the same (task, key) queue on the task row's lock
and decide one at a time: the first takes the lease and runs the job; the others
see a live holder (``skipped_running``) or a finished task (``skipped_done``).
A running task whose holder stopped renewing (killed, paused, cut off) is taken
over by the next runner with the next token; the old holder's fence then refuses
its writes.  Every decision is written to ``events`` in the transaction that
makes it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg
from opentelemetry import trace

from dedup import _errors as errors
from dedup import _leases as leases
from dedup import _limits as limits
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql
from dedup.operations import _task_stats as task_stats
from dedup.tasks import _run as task_run
from dedup.tasks._run import TaskState

log = logging.getLogger("dedup.tasks")

DEFAULT_LEASE_TTL = 30.0
"""Seconds; short on purpose: the watchdog renews at a fraction of it while the job runs."""
DEFAULT_MAX_ATTEMPTS = 3
"""Runs of one (task, key) before a failed task is left alone until forced."""
MIN_TASK_LEASE_TTL = 1.0
"""Seconds, the shortest ``lease_ttl`` of a run: the watchdog renews every ``lease_ttl *
renew_fraction``, and a shorter lease is lost to one slow round trip to Postgres."""
MAX_ATTEMPTS = 1000
"""The largest ``max_attempts``, as for the consumer: past it a failing job is retried forever."""

Job = Callable[[task_run.TaskRun], Awaitable[object]]
LeaseLostCallback = Callable[[task_run.TaskRun, errors.StaleTokenError], object]


class TaskRunner:
    """Runs jobs once per (task code, business key), coordinated through Postgres.

    Give it ``dsn`` (a pool is opened per :meth:`run`, or once for the runner
    inside ``async with``; ``pool_options`` go to ``asyncpg.create_pool``, e.g.
    ``{"statement_cache_size": 0}`` behind pgbouncer in transaction mode) or
    ``pool`` (any asyncpg pool: dedup sends and reads JSON as text, so the
    pool's codecs don't matter).  ``holder`` names this runner in leases and
    events (default ``hostname:pid:xxxxxx``).  On its own pool, the runner's
    transactions run with an idle-in-transaction timeout (``SET LOCAL``), so a
    paused runner never holds a task or lease row for long; a pool of yours
    keeps its own settings.
    """

    def __init__(
        self,
        *,
        dsn: str | None = None,
        pool: Any = None,
        holder: str | None = None,
        schema: str = sql.DEFAULT_SCHEMA,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        renew_fraction: float = leases.DEFAULT_RENEW_FRACTION,
        on_lease_lost: LeaseLostCallback | None = None,
        pool_options: Mapping[str, Any] | None = None,
    ) -> None:
        db.require_one(dsn, pool)
        self._pool_options = db.check_pool_options(pool_options, pool=pool)
        # dedup's idle timeout goes with dedup's pool; a pool of yours keeps its settings.
        self._settings: Mapping[str, str] = db.TRANSACTION_SETTINGS if pool is None else {}
        limits.check_number("max_attempts", max_attempts, 1, MAX_ATTEMPTS, whole=True)
        if not 0 < renew_fraction < 1:
            raise errors.ConfigurationError(
                f"renew_fraction must be between 0 and 1 (a fraction of the ttl), "
                f"not {renew_fraction}"
            )
        sql.quote(schema)
        self.dsn = dsn
        holder = holder or leases.default_holder()
        self.holder = limits.check_text("holder", holder, limits.MAX_NAME_BYTES)
        """This runner's name in leases and events."""
        self.schema = schema
        """The schema of dedup's tables."""
        self.max_attempts = max_attempts
        """A failed task runs again until it has this many attempts; then only when forced."""
        self.renew_fraction = renew_fraction
        """The watchdog renews the lease after this fraction of its ttl."""
        self.on_lease_lost = on_lease_lost
        """Called with the run and the error when its lease is lost (the job is cancelled too)."""
        self._pool = pool
        self._owns_pool = False
        self._schema_checked = False
        self._q = sql.Queries(schema)

    async def __aenter__(self) -> TaskRunner:
        if self._pool is None and self.dsn is not None:
            self._pool = await db.create_pool(
                self.dsn, min_size=1, max_size=4, **self._pool_options
            )
            self._owns_pool = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the pool this runner opened (a pool passed in stays open)."""
        if self._owns_pool and self._pool is not None:
            await self._pool.close()
            self._pool = None
            self._owns_pool = False

    async def _check_schema(self, pool: Any) -> None:
        """Refuse a schema that lacks a migration this dedup needs (once per runner)."""
        if not self._schema_checked:
            await migrations.check(pool, schema=self.schema)
            self._schema_checked = True

    async def run(
        self,
        task: str,
        business_key: str,
        job: Job,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        force: bool = False,
    ) -> task_run.TaskOutcome:
        """Run ``job`` for (``task``, ``business_key``) unless it ran or runs elsewhere.

        ``job`` is ``async (run: TaskRun) -> object``; its return value is
        stored as the task's result (JSON).  While it runs, its lease (of
        ``lease_ttl`` seconds, database time) is renewed every
        ``lease_ttl * renew_fraction`` seconds; if a renewal fails the job is
        cancelled and ``on_lease_lost`` is called.  ``force=True`` runs a
        succeeded (or out-of-attempts) task again and records that it was
        forced; it never takes a live lease from a running holder.
        """
        _check_run(task, business_key, lease_ttl)  # before any row is touched
        attributes = {
            "dedup.task": task,
            "dedup.key": business_key,
            "dedup.holder": self.holder,
        }
        with telemetry.tracer.start_as_current_span(f"task {task}", attributes=attributes) as span:
            try:
                outcome = await self._run(task, business_key, job, lease_ttl, force)
            except db.DATABASE_ERRORS as exc:
                if not db.is_retriable(exc):
                    raise
                raise errors.ServiceUnavailableError(
                    f"task {task} {business_key}: Postgres failed during the run ({exc!r}); "
                    "a lease this runner held expires by itself and the next run takes over"
                ) from exc
            _annotate(span, outcome)
        log.info(
            "task %s %s: %s (token %s, attempt %s)",
            task,
            business_key,
            outcome.status,
            outcome.token,
            outcome.attempts,
        )
        return outcome

    async def _run(
        self, task: str, key: str, job: Job, ttl: float, force: bool
    ) -> task_run.TaskOutcome:
        options = {"min_size": 1, "max_size": 4, **self._pool_options}
        async with db.pool_for(self.dsn, self._pool, **options) as pool:
            await self._check_schema(pool)
            claimed = await self._claim(pool, task, key, ttl, force)
            if isinstance(claimed, task_run.TaskRun):
                return await self._execute(claimed, job)
            return claimed

    async def _claim(
        self, pool: Any, task: str, key: str, ttl: float, force: bool
    ) -> task_run.TaskRun | task_run.TaskOutcome:
        """Decide, under the task row's lock, whether this runner runs the job now."""
        lease_book = leases.Leases(pool, schema=self.schema, transaction_settings=self._settings)
        resource = task_run.resource_for(task, key)
        async with pool.acquire() as conn, db.transaction(conn, self._settings):
            await self._q.task_ensure.execute(conn, task=task, business_key=key)
            row = await self._q.task_lock.fetchrow(conn, task=task, business_key=key)
            state = TaskState(row["state"])
            if state == TaskState.SUCCEEDED and not force:
                return await self._skip(conn, row, "skipped_done", "done")
            live = await lease_book.current(resource, conn=conn)
            if live is not None:
                return await self._skip(
                    conn, row, "skipped_running", "running", holder=live.holder, token=live.token
                )
            exhausted = row["attempts"] >= self.max_attempts
            if state in (TaskState.RUNNING, TaskState.FAILED) and exhausted and not force:
                return await self._give_up(conn, row)
            lease = await lease_book.acquire(
                resource, self.holder, ttl, conn=conn, namespace=task, key=key
            )
            if lease is None:  # taken directly through dedup.Leases, not by a runner
                return await self._skip(conn, row, "skipped_running", "running")
            run = task_run.TaskRun(
                task=task,
                business_key=key,
                lease=lease,
                attempt=await self._q.task_start.fetchval(
                    conn,
                    task=task,
                    business_key=key,
                    holder=self.holder,
                    token=lease.token,
                    forced=force,
                ),
                forced=force,
                pool=pool,
                lease_book=lease_book,
            )
            found = [_started(run, row, self.renew_fraction)]
            found += await _lease_warning(conn, run, self.schema)
            await events.record(conn, self.schema, found)
            return run

    async def _skip(
        self,
        conn: asyncpg.Connection,
        row: asyncpg.Record,
        status: task_run.Status,
        reason: str,
        **found: Any,
    ) -> task_run.TaskOutcome:
        """Record that this runner leaves the task alone; ``found`` overrides the row's holder."""
        holder = found.pop("holder", row["holder"])
        token = found.pop("token", row["token"])
        state = row["state"]
        event = task_run.event(
            None,
            "task_skipped",
            state,
            state,
            task=row["task"],
            business_key=row["business_key"],
            holder=self.holder,
            token=token,
            reason=reason,
            held_by=holder,
            **found,
        )
        await events.record(conn, self.schema, [event])
        return task_run.TaskOutcome(
            status=status,
            task=row["task"],
            business_key=row["business_key"],
            token=token,
            attempts=row["attempts"],
            holder=holder,
            result=task_run.stored_result(row) if status == "skipped_done" else None,
            error=found.get("error"),
        )

    async def _give_up(self, conn: asyncpg.Connection, row: asyncpg.Record) -> task_run.TaskOutcome:
        """No attempts left: a vanished holder's task becomes failed; a failed one stays so."""
        task, key = row["task"], row["business_key"]
        if row["state"] == TaskState.FAILED:
            return await self._skip(
                conn,
                row,
                "failed",
                "attempts_exhausted",
                max_attempts=self.max_attempts,
                error=f"no attempts left ({row['attempts']} of {self.max_attempts}); "
                f"last error: {row['last_error']}; run with force to try again",
            )
        error = (
            f"holder {row['holder']} (token {row['token']}) stopped renewing its lease and "
            f"no attempts are left ({row['attempts']} of {self.max_attempts})"
        )
        await self._q.task_give_up.execute(conn, task=task, business_key=key, error=error)
        event = task_run.event(
            None,
            "task_failed",
            TaskState.RUNNING,
            TaskState.FAILED,
            task=task,
            business_key=key,
            holder=self.holder,
            token=row["token"],
            error=error,
            old_holder=row["holder"],
        )
        await events.record(conn, self.schema, [event])
        return task_run.TaskOutcome(
            status="failed",
            task=task,
            business_key=key,
            token=row["token"],
            attempts=row["attempts"],
            holder=row["holder"],
            error=error,
        )

    async def _execute(self, run: task_run.TaskRun, job: Job) -> task_run.TaskOutcome:
        """Run the job under a watchdog, then record how it ended."""

        async def call() -> object:
            return await job(run)

        job_task = asyncio.ensure_future(call())

        async def lost(lease: leases.Lease, error: errors.StaleTokenError) -> None:
            run.lost = error
            job_task.cancel()
            if self.on_lease_lost is not None:
                outcome = self.on_lease_lost(run, error)
                if inspect.isawaitable(outcome):
                    await outcome

        every = run.lease.ttl * self.renew_fraction
        error: BaseException | None = None
        result: object = None
        async with run.pool.acquire() as watchdog_conn:
            watchdog = run.lease_book.watch(run.lease, lost, every=every, conn=watchdog_conn)
            async with watchdog:
                try:
                    result = await job_task
                except asyncio.CancelledError as exc:
                    current = asyncio.current_task()
                    if run.lost is None and current is not None and current.cancelling():
                        # This runner itself is being cancelled (shutdown): say so, then go.
                        await watchdog.stop()
                        await asyncio.shield(
                            self._finish(run, None, "cancelled before it finished")
                        )
                        raise
                    error = run.lost or exc
                except Exception as exc:  # the job's own failure, whatever it is
                    error = exc
        if isinstance(error, errors.StaleTokenError):
            return await self._lost(run, error, reported=run.lost is not None)
        if error is not None:
            log.warning("task %s %s failed: %r", run.task, run.business_key, error)
            return await self._finish(run, None, f"{type(error).__name__}: {error}")
        return await self._finish(run, result, None)

    async def _finish(
        self, run: task_run.TaskRun, result: object, error: str | None
    ) -> task_run.TaskOutcome:
        """Record success (``error`` None) or failure, fenced, and release the lease."""
        state = TaskState.FAILED if error is not None else TaskState.SUCCEEDED
        stored, text = task_run.to_json(result)
        keys = {"task": run.task, "business_key": run.business_key}
        try:
            async with (
                run.pool.acquire() as conn,
                db.transaction(conn, run.lease_book.transaction_settings),
            ):
                finished = await self._q.task_finish.fetchrow(
                    conn, **keys, token=run.token, state=state, result=text, error=error
                )
                if finished is None:
                    row = await self._q.task_get.fetchrow(conn, **keys)
                    if row["state"] != TaskState.SUCCEEDED or row["token"] != run.token:
                        raise await run.lease_book.stale_error(conn, run.lease)
                    # The job completed the task itself (TaskRun.complete).
                    stored, error = task_run.stored_result(row), None
                else:
                    await run.fence(conn)
                    event = task_run.event(
                        run,
                        f"task_{state}",
                        TaskState.RUNNING,
                        state,
                        attempt=run.attempt,
                        error=error,
                        duration=finished["duration"],
                    )
                    task_run.record_duration(run.task, state, finished["duration"])
                    await events.record(conn, self.schema, [event])
                await run.lease_book.release(run.lease, conn=conn)
        except errors.StaleTokenError as exc:
            return await self._lost(run, exc, reported=run.lost is not None)
        return run.outcome("failed" if error is not None else "succeeded", stored, error)

    async def _lost(
        self, run: task_run.TaskRun, error: errors.StaleTokenError, *, reported: bool
    ) -> task_run.TaskOutcome:
        """The run lost its lease: nothing more is written for it, the task belongs to another."""
        if not reported:
            await run.lease_book.report_lost(run.lease, error)
        return run.outcome("failed", None, str(error))


def check_task(task: str) -> None:
    """Refuse a task code that can't name a lease resource."""
    limits.check_text("task", task, limits.MAX_NAME_BYTES)
    if ":" in task:
        # The lease resource is task:<task>:<business key>: a ':' would make two tasks share one.
        raise errors.ConfigurationError(f"invalid task code {task!r}: it can't contain ':'")


def _check_run(task: str, business_key: str, lease_ttl: float) -> None:
    check_task(task)
    limits.check_text("business_key", business_key, limits.MAX_BUSINESS_KEY_BYTES)
    limits.check_number(
        "lease_ttl", lease_ttl, MIN_TASK_LEASE_TTL, limits.MAX_LEASE_TTL, whole=False
    )


async def _lease_warning(
    conn: asyncpg.Connection, run: task_run.TaskRun, schema: str
) -> list[events.Event]:
    """The warning of a run whose lease is under 1.5 x its task's p95 duration, if it is."""
    p95 = await task_stats.p95(conn, run.task, schema)
    if not task_stats.lease_too_short(run.lease.ttl, p95):
        return []
    telemetry.leases_too_short.add(1, {"dedup.task": run.task})
    log.warning(
        "task %s %s: lease ttl %.1f s is under %s x the p95 duration %.1f s of its runs",
        run.task,
        run.business_key,
        run.lease.ttl,
        task_stats.LEASE_MARGIN,
        p95,
    )
    return [
        task_run.event(
            run,
            "task_lease_too_short",
            TaskState.RUNNING,
            TaskState.RUNNING,
            lease_ttl=run.lease.ttl,
            p95=p95,
        )
    ]


def _started(run: task_run.TaskRun, row: asyncpg.Record, renew_fraction: float) -> events.Event:
    """The event of a run that starts: a takeover when the task's last holder vanished."""
    if row["state"] == TaskState.RUNNING:
        return task_run.event(
            run,
            "task_taken_over",
            TaskState.RUNNING,
            TaskState.RUNNING,
            old_token=row["token"],
            new_token=run.token,
            old_holder=row["holder"],
            attempt=run.attempt,
            forced=run.forced,
            lease_ttl=run.lease.ttl,
            renew_every=run.lease.ttl * renew_fraction,
        )
    return task_run.event(
        run,
        "task_started",
        row["state"],
        TaskState.RUNNING,
        attempt=run.attempt,
        forced=run.forced,
        lease_ttl=run.lease.ttl,
        renew_every=run.lease.ttl * renew_fraction,
    )


def _annotate(span: trace.Span, outcome: task_run.TaskOutcome) -> None:
    span.set_attribute("dedup.status", outcome.status)
    span.set_attribute("dedup.attempts", outcome.attempts)
    if outcome.token is not None:
        span.set_attribute("dedup.token", outcome.token)
    if outcome.status == "failed":
        span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error))
