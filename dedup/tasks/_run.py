"""One run of a task: its states, its outcome, and the handle a job writes through.

A task (one row of ``tasks`` per task code and business key) moves through
:class:`TaskState`; :class:`TaskRun` is what a job gets while it holds the
task's lease, :class:`TaskOutcome` what :meth:`dedup.TaskRunner.run` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import asyncpg
import orjson

from dedup import _errors as errors
from dedup import _leases as leases
from dedup import _limits as limits
from dedup import _outbox as outbox
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _sql as sql

log = logging.getLogger("dedup.tasks")


class TaskState(enum.StrEnum):
    """The state of a task (one ``tasks`` row): ``pending``, ``running``, ``succeeded``, ``failed``.

    A StrEnum: it equals the plain string stored in Postgres and shown by the CLI.
    """

    PENDING = "pending"
    """Known, never started."""
    RUNNING = "running"
    """A holder has the lease and runs the job (or stopped renewing and waits for a takeover)."""
    SUCCEEDED = "succeeded"
    """Done; a rerun is skipped unless forced."""
    FAILED = "failed"
    """The last run failed; the next runner retries while attempts are left."""


Status = Literal["succeeded", "failed", "skipped_done", "skipped_running"]
"""What one call of :meth:`dedup.TaskRunner.run` did (:attr:`TaskOutcome.status`)."""


def resource_for(task: str, business_key: str) -> str:
    """The lease resource of one (task, business key)."""
    return f"task:{task}:{business_key}"


@dataclasses.dataclass(frozen=True, slots=True)
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


@dataclasses.dataclass(eq=False, kw_only=True)
class TaskRun:
    """One run of a job under its lease: the token, and ways to write under it.

    Write through :meth:`transaction` (fenced at commit), or fence your own
    transactions with :meth:`fence`.  :meth:`complete` marks the task succeeded
    in the same transaction as the writes that make it so.
    """

    task: str
    """The task code."""
    business_key: str
    """The business key."""
    lease: leases.Lease
    """The lease this run holds."""
    attempt: int
    """The task's attempt number of this run (1 for the first)."""
    forced: bool
    """The run was forced (``force=True``)."""
    pool: Any
    """The runner's asyncpg pool, for the job's own queries."""
    lease_book: leases.Leases = dataclasses.field(repr=False)
    """The :class:`dedup.Leases` of the runner, which renews and fences the lease."""
    lost: errors.StaleTokenError | None = dataclasses.field(default=None, init=False)
    """Set when the lease was lost: stop writing."""
    _published: int = dataclasses.field(default=0, init=False, repr=False)

    @functools.cached_property
    def _q(self) -> sql.Queries:
        return sql.Queries(self.lease_book.schema)

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
        await self.lease_book.check(conn, self.lease)

    def outcome(self, status: Status, result: Any, error: str | None) -> TaskOutcome:
        """The :class:`TaskOutcome` of this run."""
        # In TaskOutcome's field order: status, task, key, token, attempts, holder, forced.
        found = (self.task, self.business_key, self.token, self.attempt, self.holder)
        return TaskOutcome(status, *found, self.forced, result, error)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection in a transaction that commits only if the fence holds at the end."""
        async with (
            self.pool.acquire() as conn,
            db.transaction(conn, self.lease_book.transaction_settings),
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
        finished = await self._q.task_finish.fetchrow(
            conn,
            task=self.task,
            business_key=self.business_key,
            token=self.token,
            state=TaskState.SUCCEEDED,
            result=to_json(result)[1],
            error=None,
        )
        if finished is None:
            raise await self.lease_book.stale_error(conn, self.lease)
        await self.fence(conn)
        await events.record(
            conn,
            self.lease_book.schema,
            [
                event(
                    self,
                    "task_succeeded",
                    TaskState.RUNNING,
                    TaskState.SUCCEEDED,
                    attempt=self.attempt,
                    duration=finished["duration"],
                )
            ],
        )
        record_duration(self.task, TaskState.SUCCEEDED, finished["duration"])

    async def publish(
        self,
        conn: asyncpg.Connection,
        topic: str,
        value: Any,
        *,
        key: bytes | str | None = None,
        headers: outbox.Headers | None = None,
    ) -> str:
        """Publish a record to ``topic`` once, from the job's transaction ``conn``.

        As :meth:`dedup.Tx.publish`: the record is written with the writes of
        ``conn``'s transaction (:meth:`transaction`, a step's ``step.conn``) and
        ``dedup relay`` sends it if that transaction commits.  Its row key is
        ``task:TASK:KEY:TOKEN:N``, the Nth record of this run.
        """
        n = self._published
        self._published += 1
        return await outbox.publish(
            conn,
            self.lease_book.schema,
            row_key=f"{self.resource}:{self.token}:{n}",
            topic=topic,
            value=value,
            key=key,
            headers=headers,
            source=self.resource,
            token=self.token,
        )

    @contextlib.asynccontextmanager
    async def step(self, name: str) -> AsyncIterator[Step]:
        """One step of the job, done once across reruns of the task.

        ``async with run.step("batch-7") as step:`` then, unless ``step.done``
        (an earlier run completed it: skip the body), write through
        ``step.conn``: a connection in the step's own transaction, which
        commits with the step's completion record, fenced, when the block ends
        without an error.  For a call outside Postgres, send ``step.key`` and
        ``step.token`` along, so the receiver applies it once and refuses a
        stale run.
        """
        limits.check_text("step", name, limits.MAX_NAME_BYTES)
        keys = {"task": self.task, "business_key": self.business_key, "step": name}
        key = f"{self.task}:{self.business_key}:{name}"
        async with self.pool.acquire() as conn:
            done = await self._q.step_get.fetchrow(conn, **keys)
            if done is not None:
                skipped = event(
                    self, "task_step_skipped", None, None, step=name, done_by_token=done["token"]
                )
                async with db.transaction(conn, self.lease_book.transaction_settings):
                    await events.record(conn, self.lease_book.schema, [skipped])
                yield Step(name, key, self.token, done=True, conn=None)
                return
            async with db.transaction(conn, self.lease_book.transaction_settings):
                yield Step(name, key, self.token, done=False, conn=conn)
                completed = await self._q.step_complete.fetchval(
                    conn, **keys, holder=self.holder, token=self.token, attempt=self.attempt
                )
                await self.fence(conn)
                if completed is None:  # the fence held: this very run completed it meanwhile
                    raise errors.ConfigurationError(
                        f"step {name!r} of task {self.task} {self.business_key} ran twice at "
                        "once in one run: give each step its own name"
                    )
                done_event = event(self, "task_step_done", None, None, step=name)
                await events.record(conn, self.lease_book.schema, [done_event])

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


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """A step of a job (:meth:`TaskRun.step`)."""

    name: str
    """The step's name, unique within the job."""
    key: str
    """``<task>:<business key>:<step>``: the idempotency key to send with an external call."""
    token: int
    """The run's fencing token, to send with it."""
    done: bool
    """An earlier run of the task completed this step: skip its body."""
    conn: asyncpg.Connection | None
    """A connection in the step's transaction (None when ``done``)."""


Job = Callable[[TaskRun], Awaitable[object]]
LeaseLostCallback = Callable[[TaskRun, errors.StaleTokenError], object]


def record_duration(task: str, state: str, seconds: float | None) -> None:
    """``dedup.task.duration`` of a run that ended ``state``."""
    if seconds is not None:
        telemetry.task_duration.record(seconds, {"dedup.task": task, "dedup.status": state})


def to_json(value: Any) -> tuple[Any, str | None]:
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


def stored_result(row: Any) -> Any:
    """The result of a ``task_get`` row (JSON text, see tasks.sql), parsed."""
    text = row["result"]
    return None if text is None else orjson.loads(text)


def event(
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
