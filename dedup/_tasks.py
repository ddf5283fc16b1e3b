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
import contextlib
import inspect
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg
import orjson
from opentelemetry import trace

from dedup import _db as db
from dedup import _errors as errors
from dedup import _events as events
from dedup import _leases as leases
from dedup import _migrations as migrations
from dedup import _sql as sql
from dedup import _telemetry as telemetry

log = logging.getLogger("dedup.tasks")

Status = Literal["succeeded", "failed", "skipped_done", "skipped_running"]

DEFAULT_LEASE_TTL = 30.0
"""Seconds; short on purpose: the watchdog renews at a fraction of it while the job runs."""
DEFAULT_MAX_ATTEMPTS = 3
"""Runs of one (task, key) before a failed task is left alone until forced."""


def default_holder() -> str:
    """``hostname:pid``: tells machines and processes apart in the audit trail."""
    return f"{socket.gethostname()}:{os.getpid()}"


def resource_for(task: str, business_key: str) -> str:
    """The lease resource of one (task, business key)."""
    return f"task:{task}:{business_key}"


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """What :meth:`TaskRunner.run` did for one (task, business key)."""

    status: Status
    """``succeeded`` or ``failed`` (this runner ran the job, or found no attempts left),
    ``skipped_done`` (it had succeeded before), ``skipped_running`` (a live holder has it)."""
    task: str
    """The task code."""
    business_key: str
    """The business key, e.g. the business date."""
    token: int | None
    """The fencing token of this run; for skips, that of the run found (None if never run)."""
    attempts: int
    """The task's attempt count: this run's number when it ran."""
    holder: str | None
    """Who ran it: this runner, or for skips the holder found."""
    forced: bool = False
    """This run was forced past a succeeded (or exhausted) task."""
    result: Any = None
    """The job's return value as stored (JSON), for ``succeeded`` and ``skipped_done``."""
    error: str | None = None
    """Why it failed, or why it was stopped (lost lease)."""


class TaskRun:
    """One run of a job under its lease: the token, and ways to write under it.

    Write through :meth:`transaction` (fenced at commit), or fence your own
    transactions with :meth:`fence`.  :meth:`complete` marks the task succeeded
    in the same transaction as the writes that make it so.
    """

    def __init__(
        self,
        *,
        task: str,
        business_key: str,
        lease: leases.Lease,
        attempt: int,
        forced: bool,
        pool: Any,
        leases_: leases.Leases,
    ) -> None:
        self.task = task
        """The task code."""
        self.business_key = business_key
        """The business key."""
        self.lease = lease
        """The lease this run holds."""
        self.attempt = attempt
        """The task's attempt number of this run (1 for the first)."""
        self.forced = forced
        """The run was forced (``force=True``)."""
        self.pool = pool
        """The runner's asyncpg pool, for the job's own queries."""
        self.lost: errors.StaleTokenError | None = None
        """Set when the lease was lost: stop writing."""
        self._leases = leases_
        self._q = sql.Queries(leases_.schema_name)

    @property
    def token(self) -> int:
        """This run's fencing token; larger than that of every earlier run of the task."""
        return self.lease.token

    @property
    def holder(self) -> str:
        """Who runs it."""
        return self.lease.holder

    @property
    def resource(self) -> str:
        """The lease resource, ``task:<task>:<business key>``."""
        return self.lease.resource

    async def fence(self, conn: asyncpg.Connection) -> None:
        """Raise :class:`dedup.StaleTokenError` unless this run still holds the lease.

        Call inside the transaction of your writes, right before it commits: a
        conditional UPDATE of the lease row, which also makes any takeover wait
        until your transaction ends.  On the error, let the transaction roll back.
        """
        await self._leases.check(conn, self.lease)

    def outcome(self, status: Status, result: Any, error: str | None) -> TaskOutcome:
        """The :class:`TaskOutcome` of this run."""
        return TaskOutcome(
            status=status,
            task=self.task,
            business_key=self.business_key,
            token=self.token,
            attempts=self.attempt,
            holder=self.holder,
            forced=self.forced,
            result=result,
            error=error,
        )

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection in a transaction that commits only if the fence holds at the end."""
        async with (
            self.pool.acquire() as conn,
            db.transaction(conn, self._leases.transaction_settings),
        ):
            yield conn
            await self.fence(conn)

    async def complete(self, conn: asyncpg.Connection, result: Any = None) -> None:
        """Mark the task succeeded inside the caller's transaction (fenced).

        Commit the job's last writes and the task's success together, so a
        crash between the two can never make the next runner repeat the job.
        Call it before any fence of your own in that transaction (as
        :meth:`transaction` does): the task row is locked before the lease
        row, in the same order as a runner's claim, so the two never deadlock.
        """
        if not conn.is_in_transaction():
            raise errors.ConfigurationError(
                "complete(conn) must run inside the transaction of the job's writes"
            )
        attempts = await conn.fetchval(
            self._q.task_finish,
            self.task,
            self.business_key,
            self.token,
            "succeeded",
            _json(result)[1],
            None,
        )
        if attempts is None:
            raise await self._leases.stale_error(conn, self.lease)
        await self.fence(conn)
        await events.record(
            conn,
            self._leases.schema_name,
            [_event(self, "task_succeeded", "running", "succeeded", attempt=self.attempt)],
        )

    async def write_fenced(
        self,
        conn: asyncpg.Connection,
        table: str,
        key: Mapping[str, Any],
        values: Mapping[str, Any],
    ) -> None:
        """Upsert one business row stamped with this run's token (see :func:`leases.fenced_upsert`).

        The row's ``fence_token`` column keeps the token of its last writer; a
        write under an older token raises :class:`dedup.StaleTokenError`.
        """
        await leases.fenced_upsert(
            conn, table, key, values, token=self.token, resource=self.resource
        )


Job = Callable[[TaskRun], Awaitable[object]]
LeaseLostCallback = Callable[[TaskRun, errors.StaleTokenError], object]


def _json(value: Any) -> tuple[Any, str | None]:
    """``value`` and its JSON text (None for None), or its repr if orjson can't store it.

    The job's effects are done either way.  The text goes to Postgres as text,
    cast there, so whatever json codec the pool has never sees it.
    """
    if value is None:
        return None, None
    try:
        return value, orjson.dumps(value).decode()
    except TypeError:
        log.warning("task result %r is not JSON; storing its repr", value)
        return repr(value), orjson.dumps(repr(value)).decode()


def _stored_result(row: Any) -> Any:
    """The result of a ``task_get`` row (JSON text, see queries.sql), parsed."""
    text = row["result"]
    return None if text is None else orjson.loads(text)


def _event(
    run: TaskRun | None,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    *,
    task: str | None = None,
    business_key: str | None = None,
    holder: str | None = None,
    token: int | None = None,
    **detail: Any,
) -> events.Event:
    return events.Event(
        subject="task",
        kind=kind,
        namespace=run.task if run else task,
        key=run.business_key if run else business_key,
        resource=run.resource if run else resource_for(task or "", business_key or ""),
        holder=run.holder if run else holder,
        token=run.token if run else token,
        from_state=from_state,
        to_state=to_state,
        detail={k: v for k, v in detail.items() if v is not None},
    )


class TaskRunner:
    """Runs jobs once per (task code, business key), coordinated through Postgres.

    Give it ``dsn`` (a pool is opened per :meth:`run`, or once for the runner
    inside ``async with``; ``pool_options`` go to ``asyncpg.create_pool``, e.g.
    ``{"statement_cache_size": 0}`` behind pgbouncer in transaction mode) or
    ``pool`` (any asyncpg pool: dedup sends and reads JSON as text, so the
    pool's codecs don't matter).  ``holder`` names this runner in leases and
    events (default ``hostname:pid``).  On its own pool, the runner's
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
        schema_name: str = sql.DEFAULT_SCHEMA,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        renew_fraction: float = leases.DEFAULT_RENEW_FRACTION,
        on_lease_lost: LeaseLostCallback | None = None,
        pool_options: Mapping[str, Any] | None = None,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise errors.ConfigurationError("TaskRunner needs dsn=... or pool=..., not both")
        self._pool_options = db.check_pool_options(pool_options, pool=pool)
        # dedup's idle timeout goes with dedup's pool; a pool of yours keeps its settings.
        self._settings: Mapping[str, str] = db.TRANSACTION_SETTINGS if pool is None else {}
        if max_attempts < 1:
            raise errors.ConfigurationError(f"max_attempts must be at least 1, not {max_attempts}")
        if not 0 < renew_fraction < 1:
            raise errors.ConfigurationError(
                f"renew_fraction must be between 0 and 1 (a fraction of the ttl), "
                f"not {renew_fraction}"
            )
        sql.quote(schema_name)
        self.dsn = dsn
        self.holder = holder or default_holder()
        """This runner's name in leases and events."""
        self.schema_name = schema_name
        self.max_attempts = max_attempts
        """A failed task runs again until it has this many attempts; then only when forced."""
        self.renew_fraction = renew_fraction
        """The watchdog renews the lease after this fraction of its ttl."""
        self.on_lease_lost = on_lease_lost
        """Called with the run and the error when its lease is lost (the job is cancelled too)."""
        self._pool = pool
        self._owns_pool = False
        self._schema_checked = False
        self._q = sql.Queries(schema_name)

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

    @contextlib.asynccontextmanager
    async def _pool_for_run(self) -> AsyncIterator[Any]:
        if self._pool is not None:
            await self._check_schema(self._pool)
            yield self._pool
            return
        assert self.dsn is not None  # noqa: S101 (checked in __init__)
        pool = await db.create_pool(self.dsn, min_size=1, max_size=4, **self._pool_options)
        try:
            await self._check_schema(pool)
            yield pool
        finally:
            await pool.close()

    async def _check_schema(self, pool: Any) -> None:
        """Refuse a schema that lacks a migration this dedup needs (once per runner)."""
        if not self._schema_checked:
            await migrations.check(pool, schema=self.schema_name)
            self._schema_checked = True

    async def run(
        self,
        task: str,
        business_key: str,
        job: Job,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        force: bool = False,
    ) -> TaskOutcome:
        """Run ``job`` for (``task``, ``business_key``) unless it ran or runs elsewhere.

        ``job`` is ``async (run: TaskRun) -> object``; its return value is
        stored as the task's result (JSON).  While it runs, its lease (of
        ``lease_ttl`` seconds, database time) is renewed every
        ``lease_ttl * renew_fraction`` seconds; if a renewal fails the job is
        cancelled and ``on_lease_lost`` is called.  ``force=True`` runs a
        succeeded (or out-of-attempts) task again and records that it was
        forced; it never takes a live lease from a running holder.
        """
        if not task or ":" in task:
            raise errors.ConfigurationError(
                f"invalid task code {task!r}: a non-empty name without ':'"
            )
        if not business_key:
            raise errors.ConfigurationError("the business key must not be empty")
        if lease_ttl <= 0:
            raise errors.ConfigurationError(f"lease_ttl must be positive seconds, not {lease_ttl}")
        attributes = {
            "dedup.task": task,
            "dedup.key": business_key,
            "dedup.holder": self.holder,
            "db.system.name": "postgresql",
        }
        with telemetry.tracer.start_as_current_span(f"task {task}", attributes=attributes) as span:
            try:
                async with self._pool_for_run() as pool:
                    claimed = await self._claim(pool, task, business_key, lease_ttl, force)
                    if isinstance(claimed, TaskRun):
                        outcome = await self._execute(pool, claimed, job)
                    else:
                        outcome = claimed
            except db.DATABASE_ERRORS as exc:
                if not db.is_retriable(exc):
                    raise
                raise errors.ServiceUnavailableError(
                    f"task {task} {business_key}: Postgres failed during the run ({exc!r}); "
                    "a lease this runner held expires by itself and the next run takes over"
                ) from exc
            span.set_attribute("dedup.status", outcome.status)
            span.set_attribute("dedup.attempts", outcome.attempts)
            if outcome.token is not None:
                span.set_attribute("dedup.token", outcome.token)
            if outcome.status == "failed":
                span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error))
        log.info(
            "task %s %s: %s (token %s, attempt %s)",
            task,
            business_key,
            outcome.status,
            outcome.token,
            outcome.attempts,
        )
        return outcome

    async def _claim(
        self, pool: Any, task: str, key: str, ttl: float, force: bool
    ) -> TaskRun | TaskOutcome:
        """Decide, under the task row's lock, whether this runner runs the job now."""
        lease_book = leases.Leases(
            pool, schema_name=self.schema_name, transaction_settings=self._settings
        )
        resource = resource_for(task, key)
        async with pool.acquire() as conn, db.transaction(conn, self._settings):
            await conn.execute(self._q.task_ensure, task, key)
            row = await conn.fetchrow(self._q.task_get + "\n   FOR UPDATE", task, key)
            state: str = row["state"]
            attempts: int = row["attempts"]

            async def skip(status: Status, reason: str, **found: Any) -> TaskOutcome:
                holder = found.pop("holder", row["holder"])
                token = found.pop("token", row["token"])
                event = _event(
                    None,
                    "task_skipped",
                    state,
                    state,
                    task=task,
                    business_key=key,
                    holder=self.holder,
                    token=token,
                    reason=reason,
                    held_by=holder,
                    **found,
                )
                await events.record(conn, self.schema_name, [event])
                return TaskOutcome(
                    status=status,
                    task=task,
                    business_key=key,
                    token=token,
                    attempts=attempts,
                    holder=holder,
                    result=_stored_result(row) if status == "skipped_done" else None,
                    error=found.get("error"),
                )

            if state == "succeeded" and not force:
                return await skip("skipped_done", "done")
            live = await lease_book.current(resource, conn=conn)
            if live is not None:
                return await skip(
                    "skipped_running", "running", holder=live.holder, token=live.token
                )
            if state in ("running", "failed") and attempts >= self.max_attempts and not force:
                return await self._give_up(conn, row, skip)

            lease = await lease_book.acquire(
                resource, self.holder, ttl, conn=conn, namespace=task, key=key
            )
            if lease is None:  # taken directly through dedup.Leases, not by a runner
                return await skip("skipped_running", "running")
            attempt = await conn.fetchval(
                self._q.task_start, task, key, self.holder, lease.token, force
            )
            run = TaskRun(
                task=task,
                business_key=key,
                lease=lease,
                attempt=attempt,
                forced=force,
                pool=pool,
                leases_=lease_book,
            )
            if state == "running":
                event = _event(
                    run,
                    "task_taken_over",
                    "running",
                    "running",
                    old_token=row["token"],
                    new_token=lease.token,
                    old_holder=row["holder"],
                    attempt=attempt,
                    forced=force,
                )
            else:
                event = _event(run, "task_started", state, "running", attempt=attempt, forced=force)
            await events.record(conn, self.schema_name, [event])
            return run

    async def _give_up(
        self,
        conn: asyncpg.Connection,
        row: asyncpg.Record,
        skip: Callable[..., Awaitable[TaskOutcome]],
    ) -> TaskOutcome:
        """No attempts left: a vanished holder's task becomes failed; a failed one stays so."""
        task, key = row["task"], row["business_key"]
        if row["state"] == "failed":
            return await skip(
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
        await conn.execute(self._q.task_give_up, task, key, error)
        event = _event(
            None,
            "task_failed",
            "running",
            "failed",
            task=task,
            business_key=key,
            holder=self.holder,
            token=row["token"],
            error=error,
            old_holder=row["holder"],
        )
        await events.record(conn, self.schema_name, [event])
        return TaskOutcome(
            status="failed",
            task=task,
            business_key=key,
            token=row["token"],
            attempts=row["attempts"],
            holder=row["holder"],
            error=error,
        )

    async def _execute(self, pool: Any, run: TaskRun, job: Job) -> TaskOutcome:
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
        async with pool.acquire() as watchdog_conn:
            watchdog = run._leases.watch(run.lease, lost, every=every, conn=watchdog_conn)
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

    async def _finish(self, run: TaskRun, result: object, error: str | None) -> TaskOutcome:
        """Record success (``error`` None) or failure, fenced, and release the lease."""
        state = "failed" if error is not None else "succeeded"
        stored, text = _json(result)
        try:
            async with (
                run.pool.acquire() as conn,
                db.transaction(conn, run._leases.transaction_settings),
            ):
                attempts = await conn.fetchval(
                    self._q.task_finish, run.task, run.business_key, run.token, state, text, error
                )
                if attempts is None:
                    row = await conn.fetchrow(self._q.task_get, run.task, run.business_key)
                    if row["state"] != "succeeded" or row["token"] != run.token:
                        raise await run._leases.stale_error(conn, run.lease)
                    # The job completed the task itself (TaskRun.complete).
                    state, stored, error = "succeeded", _stored_result(row), None
                else:
                    await run.fence(conn)
                    await events.record(
                        conn,
                        self.schema_name,
                        [
                            _event(
                                run,
                                f"task_{state}",
                                "running",
                                state,
                                attempt=run.attempt,
                                error=error,
                            )
                        ],
                    )
                await run._leases.release(run.lease, conn=conn)
        except errors.StaleTokenError as exc:
            return await self._lost(run, exc, reported=run.lost is not None)
        return run.outcome("failed" if error is not None else "succeeded", stored, error)

    async def _lost(
        self, run: TaskRun, error: errors.StaleTokenError, *, reported: bool
    ) -> TaskOutcome:
        """The run lost its lease: nothing more is written for it, the task belongs to another."""
        if not reported:
            await run._leases.report_lost(run.lease, error)
        return run.outcome("failed", None, str(error))
