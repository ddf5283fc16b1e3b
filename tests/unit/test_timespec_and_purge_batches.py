"""Durations, times and purge batches as the operator commands read and plan them."""

from __future__ import annotations

import datetime

import pytest

from dedup import _timespec as timespec
from dedup.operations import _retention as retention

UTC = datetime.UTC


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", datetime.timedelta(days=30)),
        ("12h", datetime.timedelta(hours=12)),
        ("90m", datetime.timedelta(minutes=90)),
        ("3600s", datetime.timedelta(seconds=3600)),
        ("1d12h", datetime.timedelta(days=1, hours=12)),
        (" 7D ", datetime.timedelta(days=7)),
    ],
)
def test_durations_take_s_m_h_d_units(text: str, expected: datetime.timedelta) -> None:
    assert timespec.parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "30", "d", "30x", "-1d", "1.5d", "30 d", "0d", "0s0m"])
def test_bad_durations_are_refused_naming_the_input(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        timespec.parse_duration(text)


def test_durations_print_the_way_they_are_read() -> None:
    assert timespec.format_duration(datetime.timedelta(days=30)) == "30d"
    assert timespec.format_duration(datetime.timedelta(minutes=90)) == "1h30m"
    assert timespec.format_duration(None) is None


def test_times_are_iso_dates_utc_unless_given_or_durations_ago() -> None:
    assert timespec.parse_time("2026-11-30") == datetime.datetime(2026, 11, 30, tzinfo=UTC)
    assert timespec.parse_time("2026-11-30T10:00:00Z") == datetime.datetime(
        2026, 11, 30, 10, tzinfo=UTC
    )
    local = timespec.parse_time("2026-11-30 11:00+01:00")
    assert local == datetime.datetime(2026, 11, 30, 10, tzinfo=UTC)
    now = datetime.datetime(2026, 11, 30, 12, tzinfo=UTC)
    ago = timespec.parse_time("2h")
    assert timespec.resolve(ago, now) == datetime.datetime(2026, 11, 30, 10, tzinfo=UTC)
    with pytest.raises(ValueError, match="invalid time 'yesterday'"):
        timespec.parse_time("yesterday")


def test_small_neighbouring_ranges_share_a_batch_and_big_ones_are_sliced() -> None:
    batches = retention.plan_batches([(0, 100), (1, 200), (3, 50), (4, 12000)], 128, 1000)
    assert [(b.lo, b.hi, b.finishes) for b in batches] == [
        (0, 256, (0, 1)),  # neighbours, 300 rows together
        (384, 512, (3,)),  # not a neighbour of range 1
        (512, 523, ()),  # 12,000 rows: 12 slices of 11 blocks, the last finishes range 4
        *[(lo, lo + 11, ()) for lo in range(523, 633, 11)],
        (633, 640, (4,)),
    ]
    assert sum(b.rows for b in batches[2:]) >= 12000


def test_a_range_near_the_batch_size_stays_whole() -> None:
    # ~1.4x the batch size: one DELETE of 7,000 rows rather than two of 3,500.
    assert [(b.lo, b.hi) for b in retention.plan_batches([(2, 7000)], 128, 5000)] == [(256, 384)]
    assert len(retention.plan_batches([(2, 8000)], 128, 5000)) == 2
    assert retention.plan_batches([], 128, 5000) == []
