"""``dedup schedule``: add, list, pause, resume, remove, backfill and run cron schedules.

Each command is a :class:`dedup.Scheduler` call; ``schedule run`` is the
scheduler process (any number of them, on any machines) and stops on SIGTERM
or SIGINT once the jobs it runs have ended.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import orjson

from dedup import _limits as limits
from dedup import _report as report
from dedup import _timespec as timespec
from dedup.cli import _common as common
from dedup.tasks import _periods as periods
from dedup.tasks import _runner as tasks
from dedup.tasks import _scheduler as scheduling


def _scheduler(args: argparse.Namespace, **given: Any) -> scheduling.Scheduler:
    return scheduling.Scheduler(
        dsn=common.dsn(args),
        schema=args.schema,
        pool_options={**common.POOL_OPTIONS, "timeout": args.connect_timeout},
        **given,
    )


async def _add(args: argparse.Namespace) -> int:
    """create a schedule, or change it (its place is kept unless the cron or zone changed)"""
    done = await _scheduler(args).add(
        args.name,
        cron=args.cron,
        task=args.task,
        job=args.job,
        timezone=args.tz,
        key_format=args.key_format,
        catch_up=args.catch_up,
        catch_up_window=args.window,
        overlap=args.overlap,
        lease_ttl=args.ttl,
        platform_timeout=args.timeout,
        start=args.start,
    )
    print(report.escape(f"schedule {args.name}: {done}"))
    return common.EXIT_OK


def _row(schedule: scheduling.Schedule) -> dict[str, Any]:
    return {
        "name": schedule.name,
        "task": schedule.task,
        "job": schedule.job,
        "cron": schedule.cron.expression,
        "timezone": schedule.cron.timezone,
        "key_format": schedule.key_format,
        "catch_up": schedule.catch_up,
        "catch_up_window": schedule.catch_up_window.total_seconds(),
        "overlap": schedule.overlap,
        "lease_ttl": schedule.lease_ttl,
        "platform_timeout": schedule.platform_timeout,
        "paused": schedule.paused,
        "next_due": schedule.next_due().isoformat(),
    }


async def _list(args: argparse.Namespace) -> int:
    """the schedules: cron, zone, task, job, policies and the next period due"""
    found = [_row(s) for s in await _scheduler(args).schedules()]
    if args.format == "json":
        print(orjson.dumps(found).decode())
        return common.EXIT_OK
    for s in found:
        state = "paused" if s["paused"] else f"next {s['next_due']}"
        print(
            report.escape(
                f"{s['name']}: {s['cron']} ({s['timezone']}) task {s['task']} {s['job']} "
                f"catch-up {s['catch_up']} overlap {s['overlap']}; {state}"
            )
        )
    return common.EXIT_OK


async def _pause(args: argparse.Namespace) -> int:
    """stop firing a schedule; periods that pass meanwhile go by its catch-up on resume"""
    await _scheduler(args).pause(args.name)
    print(report.escape(f"schedule {args.name}: paused"))
    return common.EXIT_OK


async def _resume(args: argparse.Namespace) -> int:
    """fire a paused schedule again; the periods it missed go by its catch-up"""
    await _scheduler(args).resume(args.name)
    print(report.escape(f"schedule {args.name}: resumed"))
    return common.EXIT_OK


async def _remove(args: argparse.Namespace) -> int:
    """delete a schedule (its tasks and events stay)"""
    await _scheduler(args).remove(args.name)
    print(report.escape(f"schedule {args.name}: removed"))
    return common.EXIT_OK


async def _backfill(args: argparse.Namespace) -> int:
    """run each period of a range of days once, in order

    One run per business key through the task runner: a period that already
    succeeded is skipped unless --force (audited). Exit code 1 if a run failed.
    """
    outcomes = await _scheduler(args).backfill(args.name, args.first, args.last, force=args.force)
    for o in outcomes:
        forced = ", forced" if o.forced else ""
        print(
            report.escape(
                f"task {o.task} key {o.business_key}: {o.status} (token {o.token}{forced})"
            )
        )
    failed = any(o.status == "failed" for o in outcomes)
    return common.EXIT_PROBLEM if failed else common.EXIT_OK


async def _run(args: argparse.Namespace) -> int:
    """the scheduler: fire due periods once across every scheduler, until SIGTERM"""
    scheduler = _scheduler(args, holder=args.holder, poll_interval=args.poll_interval)
    await common.run_until_signalled(scheduler.run, scheduler.stop)
    return common.EXIT_OK


def _day(text: str) -> datetime.date:
    return datetime.date.fromisoformat(text)


def _moment(text: str) -> datetime.datetime:
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} needs a UTC offset, e.g. {text}+00:00")
    return moment


def add_schedule(sub: Any) -> None:
    """``dedup schedule add|list|pause|resume|remove|backfill|run``."""
    schedule = common.command(sub, "schedule", help="cron schedules, fired once per period")
    actions = schedule.add_subparsers(dest="schedule_command", required=True, metavar="ACTION")
    p = common.command(actions, "add", _add)
    p.add_argument("name", help="the schedule's name")
    p.add_argument("job", metavar="MODULE:FUNCTION", help="async def job(run: dedup.TaskRun)")
    p.add_argument("--cron", required=True, help="five fields, or six with seconds last")
    p.add_argument("--tz", default="UTC", help="IANA time zone of the cron line (default: UTC)")
    p.add_argument("--task", required=True, help="the task code its runs take")
    p.add_argument(
        "--key-format",
        default="%Y-%m-%d",
        help="strftime of the period's time that makes the business key (default: %%Y-%%m-%%d)",
    )
    p.add_argument("--catch-up", choices=periods.CATCH_UPS, default="all")
    p.add_argument(
        "--window",
        type=common.argtype(timespec.parse_duration, "duration"),
        default=scheduling.DEFAULT_CATCH_UP_WINDOW,
        help="how far back missed periods are caught up, e.g. 7d or 12h (default: 7d)",
    )
    p.add_argument("--overlap", choices=periods.OVERLAPS, default="skip")
    p.add_argument(
        "--ttl",
        type=common.seconds(tasks.MIN_TASK_LEASE_TTL, limits.MAX_LEASE_TTL),
        default=tasks.DEFAULT_LEASE_TTL,
        help="lease seconds of each run (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=common.seconds(1, 7 * 86400),
        help="your platform's timeout of a run, in seconds, for `dedup task stats`",
    )
    p.add_argument(
        "--start",
        type=common.argtype(_moment, "time"),
        help="fire the periods from this time (ISO, with offset) instead of from now",
    )
    common.add_common(p)
    p = common.command(actions, "list", _list)
    p.add_argument("--format", choices=("table", "json"), default="table")
    common.add_common(p)
    for name, run in (("pause", _pause), ("resume", _resume), ("remove", _remove)):
        p = common.command(actions, name, run)
        p.add_argument("name", help="the schedule's name")
        common.add_common(p)
    p = common.command(actions, "backfill", _backfill)
    p.add_argument("name", help="the schedule's name")
    p.add_argument("--from", dest="first", required=True, type=common.argtype(_day, "date"))
    p.add_argument("--to", dest="last", required=True, type=common.argtype(_day, "date"))
    p.add_argument("--force", action="store_true", help="rerun periods that succeeded")
    common.add_common(p)
    p = common.command(actions, "run", _run)
    p.add_argument("--holder", help="this scheduler's name (default: hostname:pid:xxxxxx)")
    p.add_argument(
        "--poll-interval",
        type=common.seconds(0.01, 3600),
        default=scheduling.DEFAULT_POLL_INTERVAL,
        help="seconds between rounds when nothing is due sooner (default: %(default)s)",
    )
    common.add_common(p)
