"""The CLI's boundaries: numbers out of range, a purge cutoff in the future, a database
that never answers, and message content that holds terminal control characters.

Each test runs `dedup` in a subprocess against the real Postgres, as an operator
would, and checks the exit code, what was printed and the rows left behind.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

import dedup
from dedup.data import _db as db
from dedup_dev.audit import add_dead_letter, add_event, add_key, json_out, run_cli

# Anything a terminal may act on: C0 (but the lines' own newlines), DEL and C1.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
# Retitles the terminal (OSC ... BEL), returns to the line start, clears the
# screen (CSI as one C1 character, U+009B).
HOSTILE = "k\x1b]0;pwned\x07\rforged\x9b2J"
HOSTILE_IN_TABLES = "k\\x1b]0;pwned\\x07\\rforged\\x9b2J"
# Slower machines take longer to start Python than to time out.
STARTUP_MARGIN = 10.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["audit", "--since", "1h", "--limit", "99999999999999999999"],
            "argument --limit: invalid value '99999999999999999999': "
            "expected an integer from 1 to 1000000",
        ),
        (
            ["audit", "--topic", "t", "--partition", "2147483648", "--offset", "0"],
            "argument --partition: invalid value '2147483648': expected an integer from 0 to "
            "2147483647",
        ),
        (
            ["audit", "--topic", "t", "--partition", "0", "--offset", "9223372036854775808"],
            "argument --offset: invalid value '9223372036854775808': expected an integer from 0",
        ),
        (
            ["dead-letters", "show", "99999999999999999999"],
            "argument id: invalid value '99999999999999999999': expected an integer from 1 to "
            "9223372036854775807",
        ),
        (
            ["dead-letters", "replay", "1", "99999999999999999999"],
            "argument ID: invalid value '99999999999999999999'",
        ),
        (
            ["events", "--key", "k", "--since", "100000000d"],
            "argument --since: invalid duration '100000000d': expected more than 0s and at "
            "most 36500d",
        ),
        (
            ["purge", "--older-than", "1d", "--batch-size", "99999999999999999999"],
            "argument --batch-size: invalid value '99999999999999999999': expected an integer "
            "from 1 to 1000000",
        ),
        (
            ["purge", "--older-than", "1d", "--pause", "inf"],
            "argument --pause: invalid value 'inf': expected seconds from 0 to 3600",
        ),
        (["purge", "--older-than", "1d", "--pause", "nan"], "argument --pause: invalid value"),
        (
            ["purge", "--older-than", "1d", "--events-older-than", "99999999999d"],
            "argument --events-older-than: invalid duration '99999999999d'",
        ),
        (
            ["purge", "--before", "9999-12-31T23:00-02:00"],
            "argument --before: invalid time '9999-12-31T23:00-02:00': outside the years",
        ),
        (
            ["offsets", "rewind", "--group", "g", "--topic", "t", "--partition", "-1",
             "--to-offset", "0"],
            "argument --partition: invalid value '-1': expected an integer from 0 to 2147483647",
        ),
        (
            ["offsets", "skip", "--group", "g", "--topic", "t", "--partition", "0",
             "--to-offset", "99999999999999999999"],
            "argument --to-offset: invalid value '99999999999999999999'",
        ),
        (
            ["offsets", "show", "--limit", "0"],
            "argument --limit: invalid value '0': expected an integer from 1 to 1000000",
        ),
        (
            ["task", "run", "dedup_dev.task_jobs:record", "--task", "t", "--key", "k",
             "--ttl", "1e300"],
            "argument --ttl: invalid value '1e300': expected seconds from 1 to 604800",
        ),
        (
            ["task", "run", "dedup_dev.task_jobs:record", "--task", "t", "--key", "k",
             "--max-attempts", "99999999999"],
            "argument --max-attempts: invalid value '99999999999': expected an integer from 1",
        ),
        (
            ["reconcile", "--task", "t", "--date", "2026-11-30", "--connect-timeout", "-1"],
            "argument --connect-timeout: invalid value '-1': expected seconds more than 0",
        ),
        (["migrate", "--connect-timeout", "1e9"], "argument --connect-timeout: invalid value"),
    ],
)  # fmt: skip
def test_every_number_out_of_range_exits_2_naming_the_option_and_its_range(
    args: list[str], message: str
) -> None:
    # Refused before connecting: this database does not exist.
    done = run_cli(*args, dsn="postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


async def test_a_purge_refused_for_its_numbers_deletes_nothing(dsn: str, pool: Any) -> None:
    old = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    await add_key(pool, "old-1", first_seen=old)
    for args in (["--older-than", "100000000d"], ["--older-than", "1d", "--pause", "1e300"]):
        done = run_cli("purge", *args, dsn=dsn)
        assert done.returncode == 2, done.stderr
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 1


async def test_a_purge_cutoff_in_the_future_is_refused_unless_forced(dsn: str, pool: Any) -> None:
    for n in range(3):
        await add_key(pool, f"pay-{n}", offset=n)
    # A minute ahead of the database clock: "the future" is the database's, not ours.
    ahead = await pool.fetchval("SELECT now() + interval '1 minute'")
    cutoffs = ("2999-01-01", ahead.isoformat())

    for cutoff in cutoffs:
        refused = run_cli("purge", "--before", cutoff, dsn=dsn)
        assert refused.returncode == 2, refused.stderr
        assert "is not in the past (the database's now() is" in refused.stderr
        assert "pass --force to purge anyway" in refused.stderr
        assert len(refused.stderr.splitlines()) == 1
        assert refused.stdout == ""
    dry = run_cli("purge", "--before", cutoffs[0], "--dry-run", dsn=dsn)
    assert dry.returncode == 2
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 3

    forced = run_cli("purge", "--before", cutoffs[1], "--force", "--format", "json", dsn=dsn)
    assert forced.returncode == 0, forced.stderr
    assert "--force: purged with a cutoff that is not in the past" in forced.stderr
    doc = json_out(forced)
    assert (doc["forced"], doc["purged"]["processed"]) == (True, 3)
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0


async def test_a_purge_with_a_past_cutoff_is_not_marked_forced(dsn: str, pool: Any) -> None:
    await add_key(pool, "old", first_seen=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
    await add_key(pool, "new")
    done = run_cli("purge", "--before", "2021-01-01", "--format", "json", dsn=dsn)
    assert done.returncode == 0, done.stderr
    doc = json_out(done)
    assert (doc["forced"], doc["purged"]["processed"]) == (False, 1)
    assert done.stderr == ""


@pytest.fixture
def silent_server() -> Iterator[str]:
    """``host:port`` of a TCP listener on 127.0.0.1 that takes connections and never replies."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    # The kernel completes the handshakes of the backlog: connected, never answered.
    listener.listen(16)
    host, port = listener.getsockname()
    try:
        yield f"{host}:{port}"
    finally:
        listener.close()


@pytest.mark.parametrize(
    "command",
    [
        ["audit", "--since", "1h"],
        ["purge", "--older-than", "30d"],
        ["migrate"],
        ["task", "run", "dedup_dev.task_jobs:record", "--task", "t", "--key", "k"],
    ],
)
def test_a_database_that_never_answers_fails_within_the_connect_timeout_naming_it(
    silent_server: str, command: list[str]
) -> None:
    dsn = f"postgresql://app:s3cretpw@{silent_server}/shop"
    started = time.monotonic()
    done = run_cli(*command, "--connect-timeout", "1", dsn=dsn)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert took < 1 + STARTUP_MARGIN
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"Postgres at {silent_server} did not answer within 1 s" in done.stderr
    assert "--connect-timeout or DEDUP_CONNECT_TIMEOUT" in done.stderr
    assert "s3cretpw" not in done.stderr
    assert "compose/local/up" not in done.stderr


def test_the_connect_timeout_comes_from_its_variable(silent_server: str) -> None:
    dsn = f"postgresql://app@{silent_server}/shop"
    env = {"DEDUP_CONNECT_TIMEOUT": "1.5"}
    started = time.monotonic()
    done = run_cli("events", "--key", "k", dsn=dsn, env=env)
    assert time.monotonic() - started < 1.5 + STARTUP_MARGIN
    assert done.returncode == 1
    assert f"Postgres at {silent_server} did not answer within 1.5 s" in done.stderr
    bad = run_cli("events", "--key", "k", dsn=dsn, env={"DEDUP_CONNECT_TIMEOUT": "soon"})
    assert bad.returncode == 2
    assert "argument --connect-timeout: invalid value 'soon'" in bad.stderr


async def test_the_library_pool_gives_up_after_its_default_connect_timeout(
    silent_server: str,
) -> None:
    dsn = f"postgresql://app@{silent_server}/shop"
    started = time.monotonic()
    with pytest.raises(dedup.ServiceUnavailableError, match=re.escape(silent_server)):
        await asyncio.wait_for(dedup.create_pool(dsn), db.DEFAULT_CONNECT_TIMEOUT + 5)
    assert time.monotonic() - started < db.DEFAULT_CONNECT_TIMEOUT + 2
    runner = dedup.TaskRunner(dsn=dsn, pool_options={"timeout": 0.5})
    started = time.monotonic()
    with pytest.raises(
        dedup.ServiceUnavailableError, match=re.escape("did not answer within 0.5 s")
    ):
        async with runner:
            pass
    assert time.monotonic() - started < 0.5 + 2


async def _plant_hostile_rows(pool: Any) -> int:
    await add_key(pool, HOSTILE, namespace="payments")
    dead = await add_dead_letter(
        pool,
        key=HOSTILE.encode(),
        value=b'{"payment_id": "' + HOSTILE.encode() + b'"}',
        headers=[(f"h-{HOSTILE}", HOSTILE.encode()), ("plain", b"ok")],
        idempotency_key=HOSTILE,
        reason=f"handler failed: {HOSTILE}",
    )
    await add_event(
        pool, "message", "dead_lettered", namespace="payments", key=HOSTILE, holder=HOSTILE
    )
    await pool.execute(
        'INSERT INTO dedup.partitions (group_id, topic, "partition", holder, token, next_offset)'
        " VALUES ('payments', 'payments', 0, $1, 4, 5)",
        HOSTILE,
    )
    return dead


def _strings(doc: Any) -> list[str]:
    """Every string in a JSON document, its keys too."""
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in (k, *_strings(v))]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return [doc] if isinstance(doc, str) else []


async def test_control_characters_never_reach_the_terminal(dsn: str, pool: Any) -> None:
    dead = await _plant_hostile_rows(pool)
    commands = [
        ["audit", "--key", HOSTILE],
        ["audit", "--since", "1h"],
        ["events", "--key", HOSTILE],
        ["dead-letters", "list"],
        ["dead-letters", "show", str(dead)],
        ["offsets", "show", "--bootstrap-servers", ""],
    ]
    for command in commands:
        table = run_cli(*command, dsn=dsn)
        assert table.returncode == 0, (command, table.stderr)
        assert not RAW_CONTROL.search(table.stdout), (command, table.stdout)
        assert HOSTILE_IN_TABLES[:40] in table.stdout, (command, table.stdout)

        done = run_cli(*command, "--format", "json", dsn=dsn)
        assert done.returncode == 0, (command, done.stderr)
        assert not RAW_CONTROL.search(done.stdout), (command, done.stdout)
        assert "\\u009b" in done.stdout or "\\u001b" in done.stdout, (command, done.stdout)
        # The escapes read back as the very text that was stored.
        assert HOSTILE in _strings(orjson.loads(done.stdout)), command

    shown = orjson.loads(
        run_cli("dead-letters", "show", str(dead), "--format", "json", dsn=dsn).stdout
    )
    header = shown["dead_letters"][0]["headers"][0]
    assert header["name"] == f"h-{HOSTILE}"
    assert base64.b64decode(header["value"]) == HOSTILE.encode()
    table = run_cli("dead-letters", "show", str(dead), dsn=dsn).stdout
    assert f"h-{HOSTILE_IN_TABLES}=base64:" in table


async def test_an_asked_key_with_control_characters_is_escaped_when_nothing_matches(
    dsn: str,
) -> None:
    done = run_cli("audit", "--key", HOSTILE, dsn=dsn)
    assert done.returncode == 1
    assert not RAW_CONTROL.search(done.stdout)
    assert f"key={HOSTILE_IN_TABLES}" in done.stdout
