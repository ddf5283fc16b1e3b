"""A schedule's periods: when a cron line fires, and which of its due periods run now.

Pure: no database.  :class:`Cron` is a cron expression in a time zone (parsed by
croniter: five fields, or six with seconds last); :func:`decide` is the whole
scheduling policy, applied by the scheduler under the schedule row's lock with
the database's clock as ``now``:

- **catch-up**: periods whose time passed while no scheduler decided them.
  Those within :data:`ON_TIME` of ``now`` are on time and always fire; older
  ones are missed: ``none`` skips them, ``latest`` fires only the newest,
  ``all`` fires each one in the catch-up window, oldest first.
- **overlap**: what a due period does while a run of the same task is live:
  ``skip`` it, ``buffer_one`` (the first waits for the live run to end, later
  ones are skipped), or ``allow`` it to run beside (a different business key).
"""

from __future__ import annotations

import dataclasses
import datetime
import zoneinfo
from typing import Literal, get_args

import croniter

from dedup import _errors as errors

CatchUp = Literal["none", "latest", "all"]
"""What missed periods do: see the module's docstring."""
Overlap = Literal["skip", "buffer_one", "allow"]
"""What a due period does while a run of its task is live."""
CATCH_UPS: tuple[str, ...] = get_args(CatchUp)
OVERLAPS: tuple[str, ...] = get_args(Overlap)

ON_TIME = datetime.timedelta(seconds=60)
"""A period decided within this time after it came due is on time, whatever the catch-up
policy: a scheduler that restarts (a deploy) or sleeps a poll interval fires it anyway.
Fixed: it only has to be longer than a poll interval and a restart."""
MAX_PERIODS = 1000
"""At most this many periods are decided at once; the rest wait for the next decision
(a per-second cron after a day's outage is 86,400 periods)."""


@dataclasses.dataclass(frozen=True)
class Cron:
    """A cron expression read in a time zone (an IANA name such as ``Europe/Berlin``)."""

    expression: str
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        try:
            zone = zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise errors.ConfigurationError(
                f"unknown time zone {self.timezone!r}: use an IANA name such as Europe/Berlin"
            ) from exc
        if not croniter.croniter.is_valid(self.expression):
            raise errors.ConfigurationError(
                f"invalid cron expression {self.expression!r}: five fields (minute hour "
                "day-of-month month day-of-week), or six with seconds last"
            )
        object.__setattr__(self, "_zone", zone)

    @property
    def zone(self) -> zoneinfo.ZoneInfo:
        zone: zoneinfo.ZoneInfo = self.__dict__["_zone"]
        return zone

    def after(self, moment: datetime.datetime) -> datetime.datetime:
        """The first time this line fires strictly after ``moment`` (in the schedule's zone)."""
        fires = croniter.croniter(self.expression, moment.astimezone(self.zone))
        nxt: datetime.datetime = fires.get_next(datetime.datetime)
        return nxt

    def between(
        self, after: datetime.datetime, until: datetime.datetime, limit: int = MAX_PERIODS
    ) -> list[datetime.datetime]:
        """The times it fires in (``after``, ``until``], oldest first, at most ``limit``."""
        fires = croniter.croniter(self.expression, after.astimezone(self.zone))
        found: list[datetime.datetime] = []
        while len(found) < limit:
            moment: datetime.datetime = fires.get_next(datetime.datetime)
            if moment > until:
                break
            found.append(moment)
        return found


def business_key(period: datetime.datetime, key_format: str) -> str:
    """The business key of a period: its time in the schedule's zone, as ``key_format``."""
    return period.strftime(key_format)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """Due periods a decision does not run, and why."""

    periods: tuple[datetime.datetime, ...]
    reason: Literal["missed", "outside_window", "overlap"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one decision does with a schedule's due periods."""

    fire: tuple[datetime.datetime, ...]
    """The periods to run now, oldest first."""
    skipped: tuple[Skipped, ...]
    """The periods it leaves out, by reason."""
    decided_until: datetime.datetime
    """Every period up to here is decided (the schedule's new cursor)."""
    buffered: datetime.datetime | None
    """The period that waits for the live run (``buffer_one``)."""


def decide(
    cron: Cron,
    *,
    now: datetime.datetime,
    decided_until: datetime.datetime,
    catch_up: CatchUp,
    window: datetime.timedelta,
    overlap: Overlap,
    running: bool,
    buffered: datetime.datetime | None = None,
) -> Decision:
    """The periods in (``decided_until``, ``now``] to fire, skip or buffer; see the module."""
    skipped: list[Skipped] = []
    start = decided_until
    if decided_until < now - window:
        # Periods older than the window never run.  Walked MAX_PERIODS at a time
        # (a per-second cron after a long outage): the next decision goes on.
        old = cron.between(decided_until, now - window)
        skipped.append(Skipped(tuple(old), "outside_window"))
        if len(old) == MAX_PERIODS:
            return Decision((), tuple(skipped), old[-1], buffered)
        start = now - window
    due = cron.between(start, now)
    cursor = due[-1] if len(due) == MAX_PERIODS else now
    on_time = [p for p in due if now - p <= ON_TIME]
    if catch_up == "all":
        fire = due
    elif catch_up == "latest":
        fire = on_time or due[-1:]
    else:
        fire = on_time
    skipped.append(Skipped(tuple(p for p in due if p not in fire), "missed"))
    if buffered is not None and not running:
        fire = [buffered, *fire]
        buffered = None
    elif running and fire and overlap != "allow":
        if overlap == "buffer_one" and buffered is None:
            buffered, fire = fire[0], fire[1:]
        skipped.append(Skipped(tuple(fire), "overlap"))
        fire = []
    return Decision(
        fire=tuple(fire),
        skipped=tuple(s for s in skipped if s.periods),
        decided_until=cursor,
        buffered=buffered,
    )
