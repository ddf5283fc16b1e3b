"""Which layer failed for one task and business date (``dedup diagnose``).

When finance finds two statements for a day, the first question is where the
second came from.  :func:`diagnose` reads the task's runs from its events
(who started, with which token, forced or not, how each ended), the lease's
losses, and the figures of the task's declared reconcile check, and names one
finding, with the evidence:

- ``duplicate_triggering``: two holders started runs of the same period, the
  second before the first ended, neither taking over from the other (two
  schedulers or crons that do not share the lease);
- ``duplicate_execution``: one holder at a time, but the period succeeded more
  than once (a forced rerun, a rerun that repeated work), or the business
  table holds more result rows than the source says;
- ``stale_holder_refused``: a holder lost its lease and the fence refused its
  writes: the layer worked, nothing was applied twice;
- ``none``: one run at a time, one success, the figures agree.

The business table is the authority: when its figures disagree with what the
runs say, the finding follows the table and says so.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, Literal

import asyncpg
import orjson

from dedup.data import _sql as sql
from dedup.operations import _reconciliation as reconciliation

Finding = Literal["duplicate_triggering", "duplicate_execution", "stale_holder_refused", "none"]

_STARTS = ("task_started", "task_taken_over")
_ENDS = {"task_succeeded": "succeeded", "task_failed": "failed"}


@dataclasses.dataclass
class Run:
    """One run of the task, as its events tell it."""

    token: int
    holder: str
    started_at: dt.datetime
    forced: bool
    took_over: bool
    ended: str | None = None
    """``succeeded``, ``failed``, ``lost`` (its lease), or None (no end recorded)."""
    ended_at: dt.datetime | None = None

    def line(self) -> str:
        how = " (forced)" if self.forced else " (took over)" if self.took_over else ""
        end = f", {self.ended} {self.ended_at.isoformat()}" if self.ended_at else ", no end"
        started = self.started_at.isoformat()
        return f"run token {self.token} by {self.holder}{how}: started {started}{end}"


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The finding for one task and business date, with its evidence."""

    task: str
    business_date: dt.date
    finding: Finding
    summary: str
    runs: tuple[Run, ...]
    evidence: tuple[str, ...]
    source_rows: int | None
    result_rows: int | None

    @property
    def ok(self) -> bool:
        return self.finding in ("none", "stale_holder_refused")

    def lines(self) -> list[str]:
        head = f"task {self.task} {self.business_date.isoformat()}: {self.finding}: {self.summary}"
        return [head, *(f"  {r.line()}" for r in self.runs), *(f"  {e}" for e in self.evidence)]

    def as_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "business_date": self.business_date.isoformat(),
            "finding": self.finding,
            "summary": self.summary,
            "runs": [
                {
                    "token": r.token,
                    "holder": r.holder,
                    "started_at": r.started_at.isoformat(),
                    "forced": r.forced,
                    "took_over": r.took_over,
                    "ended": r.ended,
                    "ended_at": r.ended_at.isoformat() if r.ended_at else None,
                }
                for r in self.runs
            ],
            "evidence": list(self.evidence),
            "source_rows": self.source_rows,
            "result_rows": self.result_rows,
        }


async def diagnose(
    conn: asyncpg.Connection,
    task: str,
    business_date: dt.date,
    *,
    check: reconciliation.Check | None = None,
    schema: str = sql.DEFAULT_SCHEMA,
) -> Diagnosis:
    """The :class:`Diagnosis` of ``task`` for ``business_date`` (see the module).

    ``check`` is the task's reconcile check: its figures decide when the
    business table holds more than the source (None: the runs alone decide).
    """
    key = business_date.isoformat()
    rows = await sql.Queries(schema).diagnose_events.fetch(
        conn, task=task, business_key=key, resource=f"task:{task}:{key}"
    )
    runs = _runs(rows)
    lost = [r for r in rows if r["kind"] == "lease_lost"]
    source = result = None
    if check is not None:
        async with conn.transaction(isolation="repeatable_read"):
            source = (
                await reconciliation.figures(conn, check, "source", business_date, schema)
            ).rows
            result = (
                await reconciliation.figures(conn, check, "result", business_date, schema)
            ).rows
    finding, summary, evidence = _finding(runs, lost, source, result)
    if source is not None:
        evidence.append(f"result {result} rows for the date, source {source}")
    return Diagnosis(
        task, business_date, finding, summary, tuple(runs), tuple(evidence), source, result
    )


def _runs(rows: list[asyncpg.Record]) -> list[Run]:
    runs: dict[int, Run] = {}
    for row in rows:
        detail = orjson.loads(row["detail"]) if row["detail"] else {}
        if row["kind"] in _STARTS and row["token"] is not None:
            runs[row["token"]] = Run(
                token=row["token"],
                holder=row["holder"],
                started_at=row["at"],
                forced=bool(detail.get("forced")),
                took_over=row["kind"] == "task_taken_over",
            )
        elif row["token"] in runs and (row["kind"] in _ENDS or row["kind"] == "lease_lost"):
            run = runs[row["token"]]
            if run.ended is None or run.ended == "lost":
                run.ended = _ENDS.get(row["kind"], "lost")
                run.ended_at = row["at"]
    return sorted(runs.values(), key=lambda r: r.started_at)


def _finding(
    runs: list[Run], lost: list[asyncpg.Record], source: int | None, result: int | None
) -> tuple[Finding, str, list[str]]:
    overlapping = [
        (a, b)
        for i, a in enumerate(runs)
        for b in runs[i + 1 :]
        if not b.took_over
        and a.holder != b.holder
        and (a.ended_at is None or b.started_at < a.ended_at)
    ]
    succeeded = [r for r in runs if r.ended == "succeeded"]
    more_results = source is not None and result is not None and result > source
    if overlapping:
        a, b = overlapping[0]
        return (
            "duplicate_triggering",
            f"{len({r.holder for pair in overlapping for r in pair})} holders started the same "
            f"period: {b.holder} (token {b.token}) at {b.started_at.isoformat()} while "
            f"{a.holder} (token {a.token}, started {a.started_at.isoformat()}) still ran",
            [],
        )
    if len(succeeded) > 1:
        forced = [r for r in succeeded if r.forced]
        who = f"; forced by {', '.join(r.holder for r in forced)}" if forced else ""
        return (
            "duplicate_execution",
            f"one holder at a time, but the period succeeded {len(succeeded)} times{who}",
            [],
        )
    if more_results:
        note = (
            "the runs show one success, but the business table holds more rows than the "
            "source: the table is the authority (a write outside the task's runs?)"
        )
        return "duplicate_execution", note, []
    if lost:
        holders = ", ".join(sorted({r["holder"] for r in lost}))
        return (
            "stale_holder_refused",
            f"{holders} lost the lease and the fence refused its writes; nothing was applied twice",
            [],
        )
    if not runs:
        return "none", "no run recorded for the date", []
    return "none", "one run at a time, one success" if succeeded else "no successful run", []
