"""Every snippet of docs/reference/cli.md and docs/howto/audit-and-purge.md runs as written.

Each page runs, block by block in page order, against a fresh database seeded
with the story the pages tell (statement requests for 2026-11-30 consumed in
namespace ``statements``, and the ``month-end`` task).  A ``console`` block is
a list of ``$ command`` lines, each followed by its expected output; the
command runs in ``/bin/sh`` with ``DEDUP_DSN`` and ``KAFKA_BOOTSTRAP_SERVERS``
pointing at the test's services and must print exactly that (``...`` stands
for anything on a line, or for any lines when alone).  A ``sql`` block runs in
a transaction that is rolled back (it creates cluster-wide roles); a ``cron``
block's commands run the way cron runs them.  A block of any other kind fails
the test, so nothing is added to the pages without a run here.  The sections on
``dedup offsets`` (a story with a running consumer) and ``dedup migrate`` (an
empty database) are run by test_docs_offsets.py and test_docs_migrate.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from tests.conftest import ROOT
from tests.integration import docs_support

CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
PAGES = [CLI_PAGE, ROOT / "docs" / "howto" / "audit-and-purge.md"]
TOPIC = "statement-requests"

SEED = r"""
INSERT INTO dedup.processed
    (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash, status,
     first_seen, processed_at, duplicates, conflicts, last_duplicate_at)
VALUES
    ('statements', 'acct-7:2026-11-30', 'statement-requests', 2, 1041, 3,
     '\x5e0c8a4f1b2d9e7a3c6b8d0f2e4a6c81', 'processed',
     '2026-11-30 23:05:12.25+00', '2026-11-30 23:05:12.25+00', 1, 0,
     '2026-11-30 23:09:40.5+00'),
    ('statements', 'acct-8:2026-11-30', 'statement-requests', 0, 998, 3,
     '\x0d41c6e2f7a9b3580c2e4d6f8a1b3c5e', 'processed',
     '2026-11-30 23:05:12.4+00', '2026-11-30 23:05:12.4+00', 0, 0, NULL),
    ('statements', 'acct-9:2026-11-30', 'statement-requests', 1, 1203, 2,
     '\x7f3e9b1c5a2d8e4f6b0c1d3e5f7a9b2c', 'processed',
     '2026-11-30 23:05:13+00', '2026-11-30 23:05:13+00', 0, 1,
     '2026-11-30 23:11:02.125+00'),
    ('refunds', 'acct-7:2026-11-30', 'refund-requests', 0, 17, 1,
     '\x2b8d4f6a0c1e3b5d7f9a2c4e6b8d0f13', 'processed',
     '2026-12-01 08:00:00+00', '2026-12-01 08:00:00+00', 0, 0, NULL);

-- Old keys, for purge: 40 days before the database's now().
INSERT INTO dedup.processed
    (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash,
     first_seen, processed_at)
SELECT 'statements', 'acct-' || g || ':old', 'statement-requests', g % 3, g, 1, '\x00',
       now() - interval '40 days', now() - interval '40 days'
  FROM generate_series(1, 2500) AS g;

INSERT INTO dedup.dead_letters
    (namespace, group_id, topic, "partition", "offset", timestamp_ms, key, value,
     header_names, header_values, idempotency_key, reason, error, attempts, token, created_at)
VALUES
    ('statements', 'statements', 'statement-requests', 1, 1250, 1764543662000, 'acct-9',
     '{"account": "acct-9", "date": "2026-11-30", "total": 95}',
     '{traceparent}', ARRAY['00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'::bytea],
     'acct-9:2026-11-30',
     'conflict: key ''acct-9:2026-11-30'' was applied from statement-requests:1:1203 '
     'with a different payload',
     NULL, 1, 2, '2026-11-30 23:11:02.125+00'),
    ('statements', 'statements', 'statement-requests', 0, 1001, 1764543915000, 'acct-5',
     '{"account": "acct-5", "date": "2026-11-30", "total": 40}',
     '{}', '{}', 'acct-5:2026-11-30', 'handler failed 3 times',
     'UndefinedTableError: relation "statement_lines" does not exist', 3, 3,
     '2026-11-30 23:15:20+00');

INSERT INTO dedup.events
    (at, subject, kind, namespace, key, resource, holder, token, from_state, to_state,
     trace_id, detail)
VALUES
    ('2026-11-30 23:11:02.125+00', 'message', 'conflict', 'statements', 'acct-9:2026-11-30',
     'statement-requests:1', NULL, 2, NULL, NULL, '4bf92f3577b34da6a3ce929d0e0e4736',
     '{"offset": 1250}'),
    ('2026-11-30 23:11:02.125+00', 'message', 'dead_lettered', 'statements',
     'acct-9:2026-11-30', 'statement-requests:1', NULL, 2, NULL, NULL,
     '4bf92f3577b34da6a3ce929d0e0e4736',
     '{"offset": 1250, "reason": "conflict", "attempts": 1}'),
    ('2026-12-01 02:00:00.01+00', 'lease', 'lease_acquired', 'month-end', '2026-11-30',
     'task:month-end:2026-11-30', 'batch-a:4121', 1, NULL, NULL, NULL, '{"ttl": 60.0}'),
    ('2026-12-01 02:00:00.02+00', 'task', 'task_started', 'month-end', '2026-11-30',
     'task:month-end:2026-11-30', 'batch-a:4121', 1, 'pending', 'running', NULL,
     '{"attempt": 1, "forced": false}'),
    ('2026-12-01 02:01:05.3+00', 'lease', 'lease_acquired', 'month-end', '2026-11-30',
     'task:month-end:2026-11-30', 'batch-b:977', 2, NULL, NULL, NULL, '{"ttl": 60.0}'),
    ('2026-12-01 02:01:05.31+00', 'task', 'task_taken_over', 'month-end', '2026-11-30',
     'task:month-end:2026-11-30', 'batch-b:977', 2, 'running', 'running', NULL,
     '{"old_token": 1, "new_token": 2, "old_holder": "batch-a:4121", "attempt": 2,
       "forced": false}'),
    ('2026-12-01 02:03:40.8+00', 'task', 'task_succeeded', 'month-end', '2026-11-30',
     'task:month-end:2026-11-30', 'batch-b:977', 2, 'running', 'succeeded', NULL,
     '{"attempt": 2}'),
    ('2026-12-01 02:03:40.81+00', 'lease', 'lease_released', 'month-end', '2026-11-30',
     'task:month-end:2026-11-30', 'batch-b:977', 2, NULL, NULL, NULL, '{}');
"""


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    if page == CLI_PAGE:
        for own_story in (docs_support.CLI_OFFSETS, docs_support.CLI_MIGRATE):
            text = docs_support.outside(text, own_story)
    return docs_support.checked_snippets(page.name, text)


def crontab(text: str) -> list[str]:
    """The commands of a crontab (its variables are the test's own)."""
    commands = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#") or re.match(r"^\w+=", line):
            continue
        fields = line.split(maxsplit=5)
        assert len(fields) == 6, f"not a crontab entry: {line!r}"
        assert "%" not in fields[5], "an unescaped % is a newline to cron"
        commands.append(fields[5])
    return commands


async def ensure_topic(bootstrap_servers: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 3, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
async def test_every_snippet_of_the_page_runs_as_written(
    page: Path, dsn: str, pool: Any, bootstrap_servers: str
) -> None:
    await pool.execute(SEED)
    await ensure_topic(bootstrap_servers)
    env = docs_support.shell_env(dsn, bootstrap_servers)
    found = blocks(page)
    assert found, f"{page.name} has no snippets"
    for language, text in found:
        if language == "console":
            for command, expected in docs_support.console(text):
                actual = docs_support.run(command, env)
                assert docs_support.expected_pattern(expected + "\n").fullmatch(actual), (
                    f"{page.name}: `{command}` printed:\n{actual}\nthe page says:\n{expected}"
                )
        elif language == "sql":
            async with pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                try:
                    await conn.execute(text)
                    await check_roles(conn, text)
                finally:
                    await tx.rollback()
        elif language == "cron":
            for command in crontab(text):
                assert docs_support.run(command + "; echo exit $?", env).endswith("exit 0\n"), (
                    command
                )
        else:
            raise AssertionError(f"{page.name}: no way to run a {language!r} block")


async def check_roles(conn: Any, text: str) -> None:
    """Each LOGIN role the snippet creates is a member of the dedup role it names."""
    for user, group in re.findall(r"CREATE ROLE (\w+) LOGIN .*?IN ROLE (\w+)", text):
        assert await conn.fetchval("SELECT pg_has_role($1, $2, 'MEMBER')", user, group)
