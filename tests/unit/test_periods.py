"""The scheduling policy (dedup/tasks/_periods.py): due periods, catch-up, overlap; no services."""

from __future__ import annotations

import datetime as dt

import pytest

import dedup
from dedup.tasks import _periods as periods

DAILY = periods.Cron("0 0 * * *")
WEEK = dt.timedelta(days=7)
# Thirty seconds after midnight on the 4th: the 4th's period is on time.
NOW = dt.datetime(2024, 5, 4, 0, 0, 30, tzinfo=dt.UTC)
# Decided up to noon on the 1st: the 2nd and 3rd were missed.
BEFORE = dt.datetime(2024, 5, 1, 12, tzinfo=dt.UTC)


def day(d: int) -> dt.datetime:
    return dt.datetime(2024, 5, d, tzinfo=dt.UTC)


def decide(**given: object) -> periods.Decision:
    options: dict[str, object] = {
        "now": NOW,
        "decided_until": BEFORE,
        "catch_up": "all",
        "window": WEEK,
        "overlap": "skip",
        "running": False,
    }
    return periods.decide(DAILY, **{**options, **given})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("catch_up", "fired", "missed"),
    [
        ("all", [2, 3, 4], []),
        ("latest", [4], [2, 3]),  # the 4th is on time: it is the latest
        ("none", [4], [2, 3]),
    ],
)
def test_catch_up_fires_on_time_periods_and_decides_missed_ones_by_policy(
    catch_up: str, fired: list[int], missed: list[int]
) -> None:
    decision = decide(catch_up=catch_up)

    assert decision.fire == tuple(day(d) for d in fired)
    skipped = [s for s in decision.skipped if s.reason == "missed"]
    assert [p for s in skipped for p in s.periods] == [day(d) for d in missed]
    assert decision.decided_until == NOW


@pytest.mark.parametrize(("catch_up", "fired"), [("all", [2, 3]), ("latest", [3]), ("none", [])])
def test_with_no_period_on_time_latest_fires_the_newest_and_none_fires_nothing(
    catch_up: str, fired: list[int]
) -> None:
    later = dt.datetime(2024, 5, 3, 12, tzinfo=dt.UTC)

    assert decide(catch_up=catch_up, now=later).fire == tuple(day(d) for d in fired)


def test_periods_before_the_window_are_skipped_as_outside_it() -> None:
    decision = decide(
        decided_until=dt.datetime(2024, 4, 1, tzinfo=dt.UTC), window=dt.timedelta(days=2)
    )

    assert decision.fire == (day(3), day(4))
    [outside] = decision.skipped
    assert outside.reason == "outside_window"
    assert (outside.periods[0], outside.periods[-1]) == (
        dt.datetime(2024, 4, 2, tzinfo=dt.UTC),
        day(2),
    )


def test_a_long_outage_of_a_per_second_cron_is_walked_a_bounded_step_at_a_time() -> None:
    every_second = periods.Cron("* * * * * *")
    start = NOW - dt.timedelta(days=1)
    decision = periods.decide(
        every_second,
        now=NOW,
        decided_until=start,
        catch_up="all",
        window=dt.timedelta(hours=1),
        overlap="skip",
        running=False,
    )

    assert decision.fire == ()
    assert len(decision.skipped[0].periods) == periods.MAX_PERIODS
    assert decision.decided_until == start + dt.timedelta(seconds=periods.MAX_PERIODS)


@pytest.mark.parametrize(
    ("overlap", "fired", "buffered", "skipped"),
    [
        ("skip", [], None, [2, 3, 4]),
        ("buffer_one", [], 2, [3, 4]),
        ("allow", [2, 3, 4], None, []),
    ],
)
def test_overlap_while_a_run_is_live(
    overlap: str, fired: list[int], buffered: int | None, skipped: list[int]
) -> None:
    decision = decide(overlap=overlap, running=True)

    assert decision.fire == tuple(day(d) for d in fired)
    assert decision.buffered == (day(buffered) if buffered else None)
    overlapped = [p for s in decision.skipped if s.reason == "overlap" for p in s.periods]
    assert overlapped == [day(d) for d in skipped]


def test_a_buffered_period_fires_first_once_the_live_run_ended() -> None:
    decision = decide(decided_until=NOW - dt.timedelta(seconds=10), buffered=day(3))

    assert decision.fire == (day(3),)
    assert decision.buffered is None


def test_a_buffered_period_keeps_waiting_while_the_run_is_live() -> None:
    decision = decide(overlap="buffer_one", running=True, buffered=day(1))

    assert decision.buffered == day(1)
    assert decision.fire == ()


def test_cron_lines_are_read_in_their_zone_across_a_dst_change() -> None:
    berlin = periods.Cron("30 2 * * *", "Europe/Berlin")
    start = dt.datetime(2024, 3, 30, 12, tzinfo=dt.UTC)

    fires = berlin.between(start, start + dt.timedelta(days=2))

    # 02:30 does not exist on the 31st (clocks jump from 02:00 to 03:00): it fires
    # once that day all the same, as the gap ends (croniter's rule).
    assert [f.astimezone(berlin.zone).strftime("%m-%d %H:%M") for f in fires] == [
        "03-31 03:00",
        "04-01 02:30",
    ]
    assert periods.business_key(fires[0], "%Y-%m-%d") == "2024-03-31"


@pytest.mark.parametrize(
    ("expression", "zone", "named"),
    [("61 * * * *", "UTC", "61 * * * *"), ("0 0 * * *", "Mars/Olympus", "Mars/Olympus")],
)
def test_a_bad_cron_or_zone_is_a_configuration_error_naming_it(
    expression: str, zone: str, named: str
) -> None:
    with pytest.raises(dedup.ConfigurationError, match=named.replace("*", r"\*")):
        periods.Cron(expression, zone)
