"""Reconciliation: per task code and business date, do the source and the result agree?

The third layer, after coordination (leases) and execution (idempotency keys):
it blocks nothing, it finds out.  Keys purged before a late replay, a producer
that minted two ids for one payment, a fix written by hand around the fence, a
lost row: each shows up as a difference between what should have been done
(the source) and what was done (the result).

A :class:`Check` names a task code and two SQL queries.  Each takes the
business date as ``$1`` and returns one row: a row count, and a total (a sum of
amounts, or NULL when the figures have none).  ``{schema}`` in a query is
dedup's schema.  :func:`reconcile` runs both in one snapshot, so rows committed
in between cannot make a false mismatch, and returns a :class:`ReconcileReport`.  Every
run writes a ``reconcile`` event (``reconcile_ok`` or ``reconcile_mismatch``,
with both figures); a mismatch also counts ``dedup.reconcile.mismatches``.

Checks are registered by task code (:class:`Registry`):

- a module declares ``RECONCILE``: a :class:`Check`, a mapping with the same
  fields (``task`` defaults to the module's ``TASK``, else the last part of its
  name), or a list of either; name it with ``--module`` or list it in
  ``DEDUP_RECONCILE_MODULES`` (comma-separated);
- an installed package declares an entry point in the ``dedup.reconcile`` group,
  named by the task code, pointing at such a declaration
  (``statements = "dedup_services.statements:RECONCILE"``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import importlib
import importlib.metadata
import os
import sys
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup import _leases as leases
from dedup import _outbox as outbox
from dedup import _report as report
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _sql as sql

ENTRY_POINT_GROUP = "dedup.reconcile"
"""Entry points of installed packages: name = task code, value = a ``RECONCILE`` declaration."""
MODULES_VARIABLE = "DEDUP_RECONCILE_MODULES"
"""Comma-separated modules whose ``RECONCILE`` declarations are registered too."""
ALERT_URL_VARIABLE = "DEDUP_ALERT_URL"
"""Where the sweep POSTs its alerts when no alert url is given."""

Number = int | decimal.Decimal


@dataclass(frozen=True)
class Check:
    """How to reconcile one task code: a source query and a result query."""

    task: str
    """The task code, e.g. ``statements``."""
    source: str
    """SQL, ``$1`` the business date: one row of (row count, total or NULL) that should be."""
    result: str
    """SQL, ``$1`` the business date: one row of (row count, total or NULL) that is."""
    source_label: str = "source"
    """What the source figures count, in reports (``applied payments``)."""
    result_label: str = "result"
    """What the result figures count, in reports (``balance postings``)."""
    description: str = ""
    """One line for ``dedup reconcile --list``."""
    max_rows_difference: int = 0
    """A row difference up to this many rows is tolerated (the sweep's absolute threshold)."""
    max_rows_fraction: float = 0.0
    """A row difference up to this fraction of the source's rows is tolerated (relative)."""
    max_total_difference: Number = 0
    """A total difference up to this amount is tolerated (absolute)."""
    max_total_fraction: float = 0.0
    """A total difference up to this fraction of the source's total is tolerated (relative)."""

    def __post_init__(self) -> None:
        if not self.task or ":" in self.task:
            raise errors.ConfigurationError(
                f"reconcile check: invalid task code {self.task!r} (a non-empty name without ':')"
            )
        for name in ("source", "result"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise errors.ConfigurationError(
                    f"reconcile check {self.task}: {name} must be a SQL query taking the "
                    "business date as $1"
                )
        for name in (
            "max_rows_difference",
            "max_rows_fraction",
            "max_total_difference",
            "max_total_fraction",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | decimal.Decimal):
                raise errors.ConfigurationError(
                    f"reconcile check {self.task}: {name} must be a number, not {value!r}"
                )
            if not value >= 0:  # NaN too
                raise errors.ConfigurationError(
                    f"reconcile check {self.task}: {name} must be 0 or more, not {value!r}"
                )

    def tolerates(self, source: Figures, result: Figures) -> bool:
        """Is the difference between ``source`` and ``result`` within this check's thresholds?

        Rows and totals each pass when their difference is at most the absolute
        threshold or at most the fraction of the source's figure; with the
        defaults (0) only equal figures pass.
        """
        rows = abs(result.rows - source.rows)
        if rows > self.max_rows_difference and rows > self.max_rows_fraction * source.rows:
            return False
        if source.total is None or result.total is None:
            return source.total == result.total
        exact = decimal.Decimal
        total = abs(exact(result.total) - exact(source.total))
        relative = exact(str(self.max_total_fraction)) * abs(exact(source.total))
        return total <= exact(str(self.max_total_difference)) or total <= relative


@dataclass(frozen=True)
class Figures:
    """One side of a comparison."""

    rows: int
    """The row count."""
    total: Number | None
    """The total (NULL when the check counts rows only)."""


FIGURE_COLUMNS = (
    report.Column("side"),
    report.Column("label", "counts"),
    report.Column("rows", right=True),
)
TOTAL_COLUMN = report.Column("total", right=True)


@dataclass(frozen=True)
class ReconcileReport:
    """What :func:`reconcile` found for one task code and business date."""

    task: str
    """The task code."""
    business_date: dt.date
    """The business date."""
    source: Figures
    """What should have been done."""
    result: Figures
    """What was done."""
    source_label: str = "source"
    """What the source figures count."""
    result_label: str = "result"
    """What the result figures count."""
    within_thresholds: bool | None = None
    """The check's thresholds tolerate the difference (None: the report had none)."""

    @property
    def ok(self) -> bool:
        """Source and result agree on the row count and the total, or within the thresholds."""
        if self.within_thresholds is not None:
            return self.within_thresholds
        return self.source == self.result

    @property
    def exact(self) -> bool:
        """Source and result are equal."""
        return self.source == self.result

    @property
    def rows_difference(self) -> int:
        """Result rows minus source rows (negative: rows missing from the result)."""
        return self.result.rows - self.source.rows

    @property
    def total_difference(self) -> Number | None:
        """Result total minus source total (None when either has no total)."""
        if self.source.total is None or self.result.total is None:
            return None
        return _plain(self.result.total - self.source.total)

    def as_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (totals as numbers when whole, else strings)."""
        return {
            "task": self.task,
            "business_date": self.business_date.isoformat(),
            "ok": self.ok,
            "exact": self.exact,
            "source": {"label": self.source_label, **_jsonfigures(self.source)},
            "result": {"label": self.result_label, **_jsonfigures(self.result)},
            "difference": {
                "rows": self.rows_difference,
                "total": _json_number(self.total_difference),
            },
        }

    def as_report(self) -> report.Report:
        """What ``dedup reconcile`` prints: a verdict line and the figures, or the JSON."""
        total = self.total_difference
        figures = [
            {"side": "source", "label": self.source_label, **_jsonfigures(self.source)},
            {"side": "result", "label": self.result_label, **_jsonfigures(self.result)},
            {
                "side": "difference",
                "label": "result - source",
                "rows": f"{self.rows_difference:+}",
                "total": None if total is None else f"{total:+}",
            },
        ]
        has_total = self.source.total is not None or self.result.total is not None
        verdict = ("OK" if self.exact else "OK (within thresholds)") if self.ok else "MISMATCH"
        return report.Report(
            query=None,
            heading=f"reconcile {self.task} {self.business_date.isoformat()}: {verdict}",
            sections=[
                report.Section(
                    "figures",
                    "",
                    (*FIGURE_COLUMNS, TOTAL_COLUMN) if has_total else FIGURE_COLUMNS,
                    table_rows=figures,
                    in_json=False,
                )
            ],
            fields=self.as_json(),
        )

    def line(self) -> str:
        """One line of the sweep: the task, the date, the verdict and the differences."""
        total = self.total_difference
        verdict = ("OK" if self.exact else "OK within thresholds") if self.ok else "MISMATCH"
        found = f"reconcile {self.task} {self.business_date.isoformat()}: {verdict}"
        if self.exact:
            return found
        total_text = "" if total is None else f", total {total:+}"
        return f"{found} (rows {self.rows_difference:+}{total_text})"

    def render(self, format: str = "table") -> str:
        """The report as a table (``table``) or one JSON document (``json``)."""
        return self.as_report().render(format)


class Registry:
    """Reconcile checks by task code: declared in modules, or by entry points."""

    def __init__(self, checks: Iterable[Check] = ()) -> None:
        self._checks: dict[str, tuple[Check, str]] = {}
        for check in checks:
            self.add(check)
        self.from_modules = False
        """Checks were declared by modules: the sweep checks those, not the entry points."""

    @classmethod
    def default(cls, modules: Sequence[str] = ()) -> Registry:
        """The checks of ``modules`` and of ``DEDUP_RECONCILE_MODULES``; entry points on demand."""
        registry = cls()
        listed = [m.strip() for m in os.environ.get(MODULES_VARIABLE, "").split(",")]
        for name in dict.fromkeys([*modules, *filter(None, listed)]):
            registry.add_module(name)
        registry.from_modules = bool(registry._checks)
        return registry

    def add(self, check: Check, origin: str = "code") -> None:
        """Register ``check``; a second, different check for its task code is an error."""
        known = self._checks.get(check.task)
        if known is not None and known[0] != check:
            raise errors.ConfigurationError(
                f"two reconcile checks for task {check.task!r}: from {known[1]} and from {origin}"
            )
        self._checks[check.task] = (check, origin)

    def add_module(self, name: str) -> None:
        """Register the ``RECONCILE`` declaration of module ``name``."""
        module = _import(name)
        declared = getattr(module, "RECONCILE", None)
        if declared is None:
            raise errors.ConfigurationError(
                f"module {name} declares no RECONCILE (a dedup.ReconcileCheck, a mapping with "
                "task/source/result, or a list of them)"
            )
        default_task = getattr(module, "TASK", name.rpartition(".")[2])
        for check in _checks(declared, default_task, f"module {name}"):
            self.add(check, f"module {name}")

    def get(self, task: str) -> Check:
        """The check for ``task``; ConfigurationError naming the known task codes if none."""
        if task in self._checks:
            return self._checks[task][0]
        for entry in _entry_points():
            if entry.name == task:
                self._add_entry_point(entry)
                if task in self._checks:
                    return self._checks[task][0]
        raise errors.ConfigurationError(
            f"no reconcile check for task {task!r}; known: {', '.join(self.tasks()) or 'none'} "
            f"(declare RECONCILE in a module and pass --module MODULE, list it in "
            f"{MODULES_VARIABLE}, or register an entry point in the {ENTRY_POINT_GROUP!r} group)"
        )

    def tasks(self) -> list[str]:
        """Every task code known, without importing entry points."""
        return sorted({*self._checks, *(e.name for e in _entry_points())})

    def checks(self) -> list[Check]:
        """Every check, entry points loaded."""
        for entry in _entry_points():
            if entry.name not in self._checks:
                self._add_entry_point(entry)
        return [self._checks[name][0] for name in sorted(self._checks)]

    def swept(self) -> list[Check]:
        """What ``--all`` checks: the modules' checks, or, when no module declared any, every
        entry point's (an installed service's checks are not a sweep of your own database)."""
        if self.from_modules:
            return [self._checks[name][0] for name in sorted(self._checks)]
        return self.checks()

    def _add_entry_point(self, entry: importlib.metadata.EntryPoint) -> None:
        origin = f"entry point {entry.name} = {entry.value}"
        try:
            declared = entry.load()
        except (ImportError, AttributeError) as exc:
            raise errors.ConfigurationError(f"cannot load reconcile {origin}: {exc}") from exc
        for check in _checks(declared, entry.name, origin):
            if check.task == entry.name:
                self.add(check, origin)


async def reconcile(
    target: Any,
    task: str | Check,
    business_date: dt.date | str,
    *,
    registry: Registry | None = None,
    schema: str = sql.DEFAULT_SCHEMA,
    holder: str | None = None,
    alert_url: str | None = None,
) -> ReconcileReport:
    """Compare source and result of ``task`` for ``business_date``; record and return the report.

    ``target`` is a DSN, an asyncpg pool or a connection (any codecs: dedup
    sends JSON as text).  ``task`` is a
    task code, looked up in ``registry`` (default: :meth:`Registry.default`),
    or a :class:`Check`.  Both queries run in one REPEATABLE READ transaction;
    the ``reconcile`` event is written in it; a mismatch adds one to
    ``dedup.reconcile.mismatches`` (a pass adds 0: the task's series exists
    before its first mismatch).  A query that fails for a reason other than
    a transient one raises :class:`dedup.ConfigurationError` naming the task and
    the side.  With ``alert_url``, a mismatch also writes its alert to the outbox
    in that transaction, once per task and date (:func:`alert`); :func:`sweep` sends it.
    """
    check = task if isinstance(task, Check) else (registry or Registry.default()).get(task)
    day = _date(business_date)
    attributes = {
        "dedup.task": check.task,
        "dedup.key": day.isoformat(),
    }
    with telemetry.tracer.start_as_current_span(
        f"reconcile {check.task}", attributes=attributes
    ) as span:
        async with db.connection(target) as conn, conn.transaction(isolation="repeatable_read"):
            source = await figures(conn, check, "source", day, schema)
            result = await figures(conn, check, "result", day, schema)
            found = ReconcileReport(
                task=check.task,
                business_date=day,
                source=source,
                result=result,
                source_label=check.source_label,
                result_label=check.result_label,
                within_thresholds=check.tolerates(source, result),
            )
            await events.record(conn, schema, [_event(found, holder)])
            if alert_url is not None and not found.ok:
                await alert(conn, found, alert_url, schema)
        span.set_attribute("dedup.reconcile.ok", found.ok)
        # A check that passes makes the task's series (at 0), so an alert sees the first mismatch.
        telemetry.reconcile_mismatches.add(0 if found.ok else 1, {"dedup.task": check.task})
    return found


async def alert(conn: asyncpg.Connection, found: ReconcileReport, url: str, schema: str) -> bool:
    """Write ``found``'s alert to the outbox, keyed by task and date; False if one was before."""
    return await outbox.add(
        conn,
        schema,
        key=f"reconcile:{found.task}:{found.business_date.isoformat()}",
        destination=url,
        payload={"alert": "reconcile_mismatch", "summary": found.line(), **found.as_json()},
    )


@dataclass(frozen=True)
class Sweep:
    """What :func:`sweep` found: every check's report, and the alerts it sent."""

    reports: list[ReconcileReport]
    days: list[dt.date]
    alerts: list[outbox.Sent]

    @property
    def mismatches(self) -> list[ReconcileReport]:
        return [r for r in self.reports if not r.ok]

    def lines(self) -> list[str]:
        """What ``dedup reconcile --all`` prints."""
        tasks = len({r.task for r in self.reports})
        return [
            *(r.line() for r in self.reports),
            *(a.line() for a in self.alerts),
            f"{len(self.reports)} checks ({tasks} tasks, {len(self.days)} dates): "
            f"{len(self.mismatches)} mismatches",
        ]

    def as_json(self) -> dict[str, Any]:
        return {
            "reports": [r.as_json() for r in self.reports],
            "alerts": [dataclasses.asdict(a) for a in self.alerts],
        }


async def sweep(
    target: Any,
    checks: Sequence[Check],
    *,
    date: dt.date | None = None,
    since: dt.date | None = None,
    schema: str = sql.DEFAULT_SCHEMA,
    holder: str | None = None,
    alert_url: str | None = None,
) -> Sweep:
    """Reconcile every check for ``date``, or for every date from ``since`` to today.

    Today is the database's.  With ``alert_url``, each mismatch's alert is
    written to the outbox with its check (once per task and date, however often
    the sweep runs), and then every pending alert is sent.
    """
    if (date is None) == (since is None):
        raise errors.ConfigurationError("give one of a date and a first date (since)")
    if not checks:
        raise errors.ConfigurationError("no reconcile check declared")
    if alert_url is not None:
        check_alert_url(alert_url)
    async with db.connection(target) as conn:
        days = [] if date is None else [date]
        if since is not None:
            days = dates(since, await sql.Queries(schema).database_today.fetchval(conn))
        found = [
            await reconcile(conn, check, day, schema=schema, holder=holder, alert_url=alert_url)
            for day in days
            for check in checks
        ]
        sent = await outbox.send(conn, schema, [alert_url]) if alert_url is not None else []
    return Sweep(found, days, sent)


async def sweep_job(run: Any) -> dict[str, Any]:
    """The daily sweep as a task's job: every check for the day before the run's business key.

    ``dedup schedule add sweep dedup:sweep_job --task sweep --cron '0 6 * * *'``:
    the period of the 4th sweeps the 3rd.  ``run`` is the :class:`dedup.TaskRun`
    (its key an ISO date).  The checks are those of ``dedup reconcile --all``
    with no ``--module`` (``DEDUP_RECONCILE_MODULES``, else the entry points);
    alerts go to ``DEDUP_ALERT_URL`` when set.  A mismatch does not fail the
    run: its event, metric and alert say so, and the run's result lists it.
    """
    try:
        day = parse_date(run.business_key) - dt.timedelta(days=1)
    except ValueError as exc:
        raise errors.ConfigurationError(f"sweep_job: {exc} (the business key)") from None
    found = await sweep(
        run.pool,
        Registry.default().swept(),
        date=day,
        schema=run.lease_book.schema,
        holder=run.holder,
        alert_url=os.environ.get(ALERT_URL_VARIABLE) or None,
    )
    result = {
        "date": day.isoformat(),
        "checks": len(found.reports),
        "mismatches": [r.task for r in found.mismatches],
        "alerts": {a.key: a.status for a in found.alerts},
    }
    async with run.transaction() as conn:
        await run.complete(conn, result)
    return result


def check_alert_url(url: str) -> str:
    """``url`` if alerts can be POSTed to it; ConfigurationError naming it otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise errors.ConfigurationError(
            f"alert url {url!r}: expected an http:// or https:// URL with a host"
        )
    return url


def dates(first: dt.date, last: dt.date) -> list[dt.date]:
    """Every date from ``first`` to ``last``, both included."""
    return [first + dt.timedelta(days=n) for n in range((last - first).days + 1)]


def parse_date(text: str) -> dt.date:
    """A business date from ``YYYY-MM-DD``; ValueError that names the input otherwise."""
    try:
        return dt.date.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"invalid business date {text!r}: expected YYYY-MM-DD") from None


def _date(value: dt.date | str) -> dt.date:
    if isinstance(value, dt.datetime):
        raise errors.ConfigurationError(f"business date {value!r}: give a date, not a datetime")
    if isinstance(value, dt.date):
        return value
    try:
        return parse_date(value)
    except ValueError as exc:
        raise errors.ConfigurationError(str(exc)) from None


async def figures(
    conn: asyncpg.Connection, check: Check, side: str, day: dt.date, schema: str
) -> Figures:
    """The figures of ``check``'s ``side`` (``source`` or ``result``) for ``day``."""
    text = sql.render(getattr(check, side), schema)
    try:
        statement = await conn.prepare(text)
        # A query that does not depend on the date (a list of currencies) takes no $1.
        row = await statement.fetchrow(*([day] if statement.get_parameters() else []))
    except asyncpg.PostgresError as exc:
        if db.is_retriable(exc):
            raise
        raise errors.ConfigurationError(
            f"reconcile {check.task}: the {side} query failed ({type(exc).__name__}: {exc}); "
            "has the service's migration run?"
        ) from exc
    if row is None or len(row) not in (1, 2) or not isinstance(row[0], int):
        raise errors.ConfigurationError(
            f"reconcile {check.task}: the {side} query must return one row of "
            f"(count, total), not {None if row is None else tuple(row)!r}"
        )
    total = row[1] if len(row) == 2 else None
    if total is not None and not isinstance(total, int | decimal.Decimal):
        raise errors.ConfigurationError(
            f"reconcile {check.task}: the {side} total must be a number or NULL, not {total!r}"
        )
    return Figures(rows=row[0], total=None if total is None else _plain(total))


def _event(found: ReconcileReport, holder: str | None) -> events.Event:
    state = "ok" if found.ok else "mismatch"
    return events.Event(
        subject="reconcile",
        kind=f"reconcile_{state}",
        namespace=found.task,
        key=found.business_date.isoformat(),
        holder=holder or leases.default_holder(),
        to_state=state,
        detail={
            "source_rows": found.source.rows,
            "source_total": _json_number(found.source.total),
            "result_rows": found.result.rows,
            "result_total": _json_number(found.result.total),
            "rows_difference": found.rows_difference,
            "total_difference": _json_number(found.total_difference),
        },
    )


def _checks(declared: Any, default_task: str, origin: str) -> list[Check]:
    items = declared if isinstance(declared, list | tuple) else [declared]
    found = []
    for item in items:
        if isinstance(item, Check):
            found.append(item)
        elif isinstance(item, Mapping):
            names = {f.name for f in fields(Check)}
            unknown = sorted(set(item) - names)
            if unknown:
                raise errors.ConfigurationError(
                    f"reconcile check from {origin}: unknown field(s) {', '.join(unknown)}"
                )
            found.append(Check(**{"task": default_task, **item}))
        else:
            raise errors.ConfigurationError(
                f"reconcile check from {origin}: expected a dedup.ReconcileCheck or a mapping, "
                f"not {type(item).__name__}"
            )
    return found


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _import(name: str) -> Any:
    # Like `python -m`: a module next to where the command runs is found.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise errors.ConfigurationError(f"cannot import reconcile module {name}: {exc}") from exc


def _plain(value: Number) -> Number:
    """A whole Decimal as int, so totals print and compare as the numbers they are."""
    if isinstance(value, decimal.Decimal) and value == value.to_integral_value():
        return int(value)
    return value


def _json_number(value: Number | None) -> int | str | None:
    return value if value is None or isinstance(value, int) else str(value)


def _jsonfigures(figures: Figures) -> dict[str, Any]:
    return {"rows": figures.rows, "total": _json_number(figures.total)}
