"""Least privilege (sql/0003_roles.sql): a read-only audit role and a runtime role without DDL.

The group roles are NOLOGIN; each test logs in as a fresh LOGIN user granted
one of them, the way a deployment would.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

import dedup
from dedup import _sql as sql
from dedup_dev import effects as support
from tests import helpers
from tests.conftest import LoginAs, Topics
from tests.support.audit import add_dead_letter, add_event, add_key, json_out, run_cli

RUNTIME_PRIVILEGES = {"SELECT", "INSERT", "UPDATE", "DELETE"}
# Tables whose rows the runtime role may not change once written.
RUNTIME_EXCEPTIONS = {"events": {"SELECT", "INSERT"}, "migrations": {"SELECT"}}
ALL_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


async def _privileges(pool: Any, role: str) -> dict[str, set[str]]:
    rows = await pool.fetch(
        "SELECT c.relname, p.name FROM pg_class c CROSS JOIN unnest($2::text[]) AS p(name)"
        " WHERE c.relnamespace = 'dedup'::regnamespace AND c.relkind IN ('r', 'p')"
        "   AND has_table_privilege($1, c.oid, p.name)",
        role,
        list(ALL_PRIVILEGES),
    )
    found: dict[str, set[str]] = {}
    for row in rows:
        found.setdefault(row["relname"], set()).add(row["name"])
    return found


async def test_every_table_is_granted_to_both_roles_and_they_cannot_log_in(pool: Any) -> None:
    tables = {
        r["relname"]
        for r in await pool.fetch(
            "SELECT relname FROM pg_class WHERE relnamespace = 'dedup'::regnamespace"
            " AND relkind IN ('r', 'p')"
        )
    }
    assert {"processed", "events", "dead_letters", "partitions", "leases", "tasks"} <= tables
    assert await _privileges(pool, "dedup_audit") == {t: {"SELECT"} for t in tables}
    assert await _privileges(pool, "dedup_runtime") == {
        t: RUNTIME_EXCEPTIONS.get(t, RUNTIME_PRIVILEGES) for t in tables
    }
    roles = await pool.fetch(
        "SELECT rolname, rolcanlogin, rolcreaterole, rolcreatedb, rolsuper FROM pg_roles"
        " WHERE rolname IN ('dedup_runtime', 'dedup_audit')"
    )
    assert len(roles) == 2
    assert not any(r[k] for r in roles for k in ("rolcanlogin", "rolcreaterole", "rolsuper"))


async def test_tables_of_later_migrations_are_covered_and_the_grants_rerun(pool: Any) -> None:
    # A later migration, run by the same migrating role, creates a table.
    await pool.execute("CREATE TABLE dedup.later (id bigint GENERATED ALWAYS AS IDENTITY, x text)")
    assert (await _privileges(pool, "dedup_audit"))["later"] == {"SELECT"}
    assert (await _privileges(pool, "dedup_runtime"))["later"] == RUNTIME_PRIVILEGES

    # The roles migration is safe to apply again (another database, another schema).
    roles = (sql.migrations_dir() / "0003_roles.sql").read_text()
    await pool.execute(sql.render(roles, "dedup"))
    await dedup.migrate(pool, schema="tenant_b")
    assert (await _privileges(pool, "dedup_runtime"))["events"] == {"SELECT", "INSERT"}
    grants = await pool.fetchval(
        "SELECT has_table_privilege('dedup_audit', 'tenant_b.processed', 'SELECT')"
        " AND NOT has_table_privilege('dedup_runtime', 'tenant_b.events', 'DELETE')"
    )
    assert grants


async def test_audit_and_events_work_under_the_read_only_role(
    dsn: str, pool: Any, login_as: LoginAs
) -> None:
    await add_key(pool, "pay-1", duplicates=1)
    await add_event(pool, "message", "conflict", namespace="payments", key="pay-1", token=4)
    await add_dead_letter(pool, offset=3, idempotency_key="pay-3")
    auditor = await login_as("dedup_audit")

    keys = json_out(run_cli("audit", "--key", "pay-1", "--format", "json", dsn=auditor))
    assert [r["duplicates"] for r in keys["processed"]] == [1]
    found = json_out(run_cli("events", "--key", "pay-1", "--format", "json", dsn=auditor))
    assert [e["token"] for e in found["events"]] == [4]
    window = run_cli("audit", "--since", "1h", "--status", "duplicate", dsn=auditor)
    assert window.returncode == 0, window.stderr
    listed = run_cli("dead-letters", "list", dsn=auditor)
    assert listed.returncode == 0, listed.stderr
    assert "pay-3" in listed.stdout

    refused = run_cli("purge", "--older-than", "1d", dsn=auditor)
    assert refused.returncode == 2
    assert "this role may not delete from processed and dead_letters" in refused.stderr

    conn = await asyncpg.connect(auditor)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(
                "INSERT INTO dedup.events (subject, kind) VALUES ('message', 'forged')"
            )
    finally:
        await conn.close()


RUNTIME_REFUSED = [
    "DROP TABLE dedup.processed",
    "ALTER TABLE dedup.processed ADD COLUMN x int",
    "ALTER TABLE dedup.events DISABLE TRIGGER ALL",
    "TRUNCATE dedup.processed",
    "TRUNCATE dedup.events",
    "CREATE TABLE dedup.mine (x int)",
    "CREATE INDEX ON dedup.processed (topic)",
    "DROP INDEX dedup.processed_first_seen_brin",
    "DROP SCHEMA dedup CASCADE",
    "UPDATE dedup.events SET kind = 'rewritten'",
    "DELETE FROM dedup.events",
    "DELETE FROM dedup.migrations",
    "ALTER ROLE dedup_runtime SUPERUSER",
]
PERMISSION = "permission denied|must be owner|must be superuser"


async def test_the_runtime_role_uses_the_tables_but_changes_no_structure_or_history(
    dsn: str, pool: Any, login_as: LoginAs
) -> None:
    await add_event(pool, "message", "conflict", namespace="payments", key="pay-1")
    runtime = await login_as("dedup_runtime")
    conn = await asyncpg.connect(runtime)
    try:
        for statement in RUNTIME_REFUSED:
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match=PERMISSION) as refused:
                await conn.execute(statement)
            assert refused.value.sqlstate == "42501", statement

        # What a consumer and a task runner do is allowed.
        await conn.execute(
            "INSERT INTO dedup.processed (namespace, idempotency_key, payload_hash)"
            " VALUES ('payments', 'pay-9', '\\x00')"
        )
        await conn.execute("UPDATE dedup.processed SET duplicates = 1")
        await conn.execute("INSERT INTO dedup.events (subject, kind) VALUES ('task', 'x')")
        await conn.execute(
            'INSERT INTO dedup.dead_letters (namespace, topic, "partition", "offset", reason)'
            " VALUES ('payments', 't', 0, 1, 'r')"
        )
        await conn.execute(
            "INSERT INTO dedup.leases (resource, holder, token, ttl, acquired_at, renewed_at,"
            " expires_at) VALUES ('r', 'h', 1, '1 minute', now(), now(), now())"
        )
        await conn.execute("DELETE FROM dedup.processed WHERE idempotency_key = 'pay-9'")
    finally:
        await conn.close()
    assert await pool.fetchval("SELECT count(*) FROM dedup.events") == 2


async def test_purge_runs_as_the_runtime_role_but_events_need_the_owner(
    dsn: str, pool: Any, login_as: LoginAs
) -> None:
    await pool.execute(
        "INSERT INTO dedup.processed (namespace, idempotency_key, payload_hash, first_seen,"
        " processed_at) SELECT 'payments', 'old-' || g, '\\x00', now() - interval '40 days',"
        " now() - interval '40 days' FROM generate_series(1, 50) g"
    )
    runtime = await login_as("dedup_runtime")

    done = json_out(run_cli("purge", "--older-than", "30d", "--format", "json", dsn=runtime))
    assert done["purged"]["processed"] == 50
    # Not the owner: the purged BRIN ranges keep their summaries (counted, not fatal).
    assert done["brin_ranges_resummarized"] == 0
    assert done["brin_ranges_not_resummarized"] == 1
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0

    refused = run_cli("purge", "--older-than", "30d", "--events-older-than", "90d", dsn=runtime)
    assert refused.returncode == 2
    assert "may not delete events" in refused.stderr


async def test_a_consumer_that_cannot_take_its_partitions_fails_loudly(
    login_as: LoginAs, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """aiokafka only logs what a rebalance listener raises; run() must raise it instead."""
    topic = await topics.create()
    await helpers.produce(bootstrap_servers, topic, [(None, b'{"id": "m0"}')])
    # The runtime role may not write partition rows in this database: taking fails for good.
    await pool.execute("REVOKE INSERT, UPDATE ON dedup.partitions FROM dedup_runtime")
    runtime = await dedup._db.create_pool(await login_as("dedup_runtime"), max_size=3)
    consumer = support.consumer(support.record_effect, topic, bootstrap_servers, runtime)
    try:
        started = time.monotonic()
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="partitions"):
            await asyncio.wait_for(consumer.run(), 60)
        assert time.monotonic() - started < 30
    finally:
        await runtime.close()
