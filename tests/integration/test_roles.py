"""Least privilege (sql/0004_schema_roles.sql): each schema's own read-only audit role and
runtime role without DDL, which reach no other application's schema.

The group roles are NOLOGIN; each test logs in as a fresh LOGIN user granted
one of them, the way a deployment would.  The test database is a clone of the
run's template, so its schema ``dedup`` is granted to the template's roles
(read from ``dedup.roles``).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import dedup
from dedup.data import _migrations as migrations
from dedup_dev import docs as docs_support
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.audit import add_dead_letter, add_event, add_key, json_out, run_cli
from dedup_dev.database import LoginAs, NewDatabase
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT, with_database

RUNTIME_PRIVILEGES = {"SELECT", "INSERT", "UPDATE", "DELETE"}
# Tables whose rows the runtime role may not change once written.
RUNTIME_EXCEPTIONS = {"events": {"SELECT", "INSERT"}, "migrations": {"SELECT"}, "roles": {"SELECT"}}
ALL_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
AUDIT_PAGE = ROOT / "docs" / "howto" / "audit-and-purge.md"


async def _privileges(pool: Any, role: str, schema: str = "dedup") -> dict[str, set[str]]:
    rows = await pool.fetch(
        "SELECT c.relname, p.name FROM pg_class c CROSS JOIN unnest($2::text[]) AS p(name)"
        " WHERE c.relnamespace = $3::regnamespace AND c.relkind IN ('r', 'p')"
        "   AND has_table_privilege($1, c.oid, p.name)",
        role,
        list(ALL_PRIVILEGES),
        schema,
    )
    found: dict[str, set[str]] = {}
    for row in rows:
        found.setdefault(row["relname"], set()).add(row["name"])
    return found


async def _tables(pool: Any, schema: str = "dedup") -> set[str]:
    rows = await pool.fetch(
        "SELECT relname FROM pg_class WHERE relnamespace = $1::regnamespace"
        " AND relkind IN ('r', 'p')",
        schema,
    )
    return {r["relname"] for r in rows}


async def _roles(pool: Any, schema: str = "dedup") -> tuple[str, str]:
    """(runtime, audit): the group roles ``schema`` was granted to."""
    found = await migrations.roles(pool, schema=schema)
    assert found.runtime and found.audit, f"schema {schema} records no roles"
    return found.runtime, found.audit


async def test_every_table_is_granted_to_both_roles_and_they_cannot_log_in(pool: Any) -> None:
    tables = await _tables(pool)
    assert {"processed", "events", "dead_letters", "partitions", "leases", "tasks"} <= tables
    runtime, audit = await _roles(pool)
    template = await pool.fetchval("SELECT current_database()")  # cloned: the names came along
    assert re.fullmatch(r"dedup_tpl_\w+_dedup_runtime", runtime), (runtime, template)
    assert audit == runtime.removesuffix("_runtime") + "_audit"
    assert await _privileges(pool, audit) == {t: {"SELECT"} for t in tables}
    assert await _privileges(pool, runtime) == {
        t: RUNTIME_EXCEPTIONS.get(t, RUNTIME_PRIVILEGES) for t in tables
    }
    roles = await pool.fetch(
        "SELECT rolname, rolcanlogin, rolcreaterole, rolcreatedb, rolsuper FROM pg_roles"
        " WHERE rolname IN ($1, $2)",
        runtime,
        audit,
    )
    assert len(roles) == 2
    assert not any(r[k] for r in roles for k in ("rolcanlogin", "rolcreaterole", "rolsuper"))
    # The cluster-wide roles of dedup 0.2.0 get nothing on a new schema.
    for legacy in ("dedup_runtime", "dedup_audit"):
        if await pool.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", legacy):
            assert await _privileges(pool, legacy) == {}


async def test_tables_of_later_migrations_are_covered_and_the_grants_rerun(pool: Any) -> None:
    runtime, audit = await _roles(pool)
    # A later migration, run by the same migrating role, creates a table.
    await pool.execute("CREATE TABLE dedup.later (id bigint GENERATED ALWAYS AS IDENTITY, x text)")
    assert (await _privileges(pool, audit))["later"] == {"SELECT"}
    assert (await _privileges(pool, runtime))["later"] == RUNTIME_PRIVILEGES

    # The roles migration is safe to apply again, as `dedup migrate --sql` text is.
    (roles_migration,) = [
        m for m in migrations.discover(migrations.sql.migrations_dir()) if m.version == 4
    ]
    await pool.execute(roles_migration.sql("dedup", migrations.Roles(runtime, audit)))
    assert (await _privileges(pool, runtime))["events"] == {"SELECT", "INSERT"}

    # Another schema gets roles of its own; this schema's reach nothing there.
    await dedup.migrate(pool, schema="tenant_b")
    database = await pool.fetchval("SELECT current_database()")
    assert await _roles(pool, "tenant_b") == (
        f"{database}_tenant_b_runtime",
        f"{database}_tenant_b_audit",
    )
    assert (await _privileges(pool, f"{database}_tenant_b_audit", "tenant_b"))["processed"] == {
        "SELECT"
    }
    assert await _privileges(pool, runtime, "tenant_b") == {}
    assert await _privileges(pool, audit, "tenant_b") == {}


async def test_audit_and_events_work_under_the_read_only_role(
    dsn: str, pool: Any, login_as: LoginAs
) -> None:
    await add_key(pool, "pay-1", duplicates=1)
    await add_event(pool, "message", "conflict", namespace="payments", key="pay-1", token=4)
    await add_dead_letter(pool, offset=3, idempotency_key="pay-3")
    auditor = await login_as((await _roles(pool))[1])

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
    assert "this role may not delete from processed, dead_letters and outbox" in refused.stderr

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
    "UPDATE dedup.roles SET role_name = 'mine'",
    "DELETE FROM dedup.roles",
    "ALTER ROLE {runtime} SUPERUSER",
]
PERMISSION = "permission denied|must be owner|must be superuser"


async def test_the_runtime_role_uses_the_tables_but_changes_no_structure_or_history(
    dsn: str, pool: Any, login_as: LoginAs
) -> None:
    await add_event(pool, "message", "conflict", namespace="payments", key="pay-1")
    runtime_role = (await _roles(pool))[0]
    runtime = await login_as(runtime_role)
    conn = await asyncpg.connect(runtime)
    try:
        for statement in RUNTIME_REFUSED:
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match=PERMISSION) as refused:
                await conn.execute(statement.format(runtime=runtime_role))
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
    runtime = await login_as((await _roles(pool))[0])

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
    runtime_role = (await _roles(pool))[0]
    # The runtime role may not write partition rows in this database: taking fails for good.
    await pool.execute(f'REVOKE INSERT, UPDATE ON dedup.partitions FROM "{runtime_role}"')
    runtime = await dedup.data._db.create_pool(await login_as(runtime_role), max_size=3)
    consumer = support.consumer(support.record_effect, topic, bootstrap_servers, runtime)
    try:
        started = time.monotonic()
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="partitions"):
            await asyncio.wait_for(consumer.run(), 60)
        assert time.monotonic() - started < 30
    finally:
        await runtime.close()


# --- one application's role against another application's tables --------------------

# What a stolen or misused runtime login would do to another application, by table.
TRESPASS = [
    "SELECT idempotency_key FROM {schema}.processed",
    "DELETE FROM {schema}.processed",
    "UPDATE {schema}.partitions SET next_offset = 1000000",
    "INSERT INTO {schema}.events (subject, kind) VALUES ('task', 'forged')",
    "UPDATE {schema}.tasks SET state = 'succeeded'",
]


async def _application_b_rows(dsn: str, schema: str) -> None:
    """A key, a partition position and a failed task in ``schema``, written by the owner."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f"INSERT INTO {schema}.processed (namespace, idempotency_key, payload_hash)"
            " VALUES ('refunds', 'ref-1', '\\x00');"
            f'INSERT INTO {schema}.partitions (group_id, topic, "partition", holder, token,'
            " next_offset) VALUES ('refunds', 'refund-requests', 0, 'h', 1, 17);"
            f"INSERT INTO {schema}.tasks (task, business_key, state) VALUES ('refund', 'r-1',"
            " 'failed')"
        )
    finally:
        await conn.close()


async def _application_b_state(dsn: str, schema: str) -> tuple[Any, ...]:
    conn = await asyncpg.connect(dsn)
    try:
        return tuple(
            [
                await conn.fetchval(f"SELECT count(*) FROM {schema}.processed"),
                await conn.fetchval(f"SELECT next_offset FROM {schema}.partitions"),
                await conn.fetchval(f"SELECT count(*) FROM {schema}.events"),
                await conn.fetchval(f"SELECT state FROM {schema}.tasks"),
            ]
        )
    finally:
        await conn.close()


async def test_one_applications_role_is_refused_on_every_table_of_another(
    dsn: str,
    pool: Any,
    login_as: LoginAs,
    new_database: NewDatabase,
    bootstrap_servers: str,
    topics: Topics,
) -> None:
    # Application A: schema payments of this database.  Application B twice: schema
    # refunds of this database, and a schema also called payments in another database.
    other = await new_database()
    for target, schema in ((dsn, "payments"), (dsn, "refunds"), (other, "payments")):
        done = run_cli("migrate", "--schema", schema, dsn=target)
        assert done.returncode == 0, done.stderr
    database, other_database = urlsplit(dsn).path[1:], urlsplit(other).path[1:]
    a_runtime, _ = await _roles(pool, "payments")
    assert a_runtime == f"{database}_payments_runtime"
    login = await login_as(a_runtime)
    b_applications = [
        (dsn, login, "refunds"),
        (other, with_database(login, other_database), "payments"),
    ]

    for owner, as_a, schema in b_applications:
        await _application_b_rows(owner, schema)
        before = await _application_b_state(owner, schema)
        conn = await asyncpg.connect(owner)
        try:
            b_tables = await _tables(conn, schema)
        finally:
            await conn.close()
        assert {"processed", "partitions", "events", "tasks", "leases", "dead_letters"} <= b_tables
        conn = await asyncpg.connect(as_a)
        try:
            statements = [s.format(schema=schema) for s in TRESPASS]
            statements += [f"SELECT * FROM {schema}.{table}" for table in sorted(b_tables)]
            for statement in statements:
                with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied"):
                    await conn.execute(statement)
        finally:
            await conn.close()
        assert await _application_b_state(owner, schema) == before

    # A's own work, as that login: a consumer, a claim in the caller's transaction, a task.
    await pool.execute(support.EFFECTS)
    await pool.execute(f'GRANT ALL ON effects, effects_id_seq TO "{a_runtime}"')
    topic = await topics.create()
    await helpers.produce(
        bootstrap_servers, topic, [(None, b'{"id": "p-%d"}' % i) for i in range(3)]
    )
    as_a_pool = await dedup.data._db.create_pool(login, max_size=4)
    try:
        consumer = support.consumer(
            support.record_effect, topic, bootstrap_servers, as_a_pool, schema="payments"
        )
        async with support.running(consumer):
            await helpers.wait_for(lambda: support.handled(consumer, 3), what="3 records handled")
        async with as_a_pool.acquire() as conn, conn.transaction():
            claimed = await dedup.claim(
                conn,
                [dedup.Message(topic, 0, 9, None, b'{"id": "p-9"}', {}, 0)],
                namespace="manual",
                key=dedup.keys.json_field("id"),
                schema="payments",
            )
        assert [m.idempotency_key for m in claimed.fresh] == ["p-9"]

        async def month_end(run: dedup.TaskRun) -> str:
            return "sent"

        runner = dedup.TaskRunner(pool=as_a_pool, schema="payments")
        outcome = await runner.run("month-end", "2026-11-30", month_end)
        assert outcome.status == "succeeded"
    finally:
        await as_a_pool.close()
    keys = await pool.fetch("SELECT idempotency_key FROM payments.processed ORDER BY 1")
    assert [r["idempotency_key"] for r in keys] == ["p-0", "p-1", "p-2", "p-9"]
    assert await support.effect_counts(pool) == (3, 3)
    assert await pool.fetchval("SELECT state FROM payments.tasks") == "succeeded"


async def test_a_role_that_reaches_another_application_is_refused_and_nothing_is_written(
    dsn: str, pool: Any, new_database: NewDatabase
) -> None:
    other = await new_database()
    other_database = urlsplit(other).path[1:]
    # Named like a derived role of the other database, so that dropping it drops the role.
    role = f"{other_database}_app_runtime"
    done = run_cli("migrate", "--schema", "payments", "--runtime-role", role, dsn=other)
    assert done.returncode == 0, done.stderr
    for target, schema, reached in (
        (other, "refunds", "schema payments of this database"),
        (dsn, "refunds", f"database {other_database}"),
    ):
        done = run_cli("migrate", "--schema", schema, "--runtime-role", role, dsn=target)
        assert done.returncode == 2, done.stdout
        assert done.stderr == (
            f'dedup migrate: schema "{schema}": role {role} already has privileges in '
            f"{reached}: a runtime role serves one application's schema; name another with "
            "--runtime-role\n"
        )
        conn = await asyncpg.connect(target)
        try:
            assert await conn.fetchval("SELECT to_regnamespace($1)", schema) is None
        finally:
            await conn.close()

    runtime, audit = await _roles(pool)
    done = run_cli("migrate", "--runtime-role", "someone_else", dsn=dsn)
    assert done.returncode == 2
    assert done.stderr == (
        f'dedup migrate: the runtime role of schema "dedup" is "{runtime}" (since it was '
        f'migrated), not "someone_else": grant it to the login instead (GRANT "{runtime}" TO '
        "...)\n"
    )
    same = run_cli("migrate", "--runtime-role", runtime, "--audit-role", audit, dsn=dsn)
    assert (same.returncode, same.stdout) == (0, "schema dedup is up to date (0 applied now)\n")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--runtime-role", "Payments-RT"], "invalid runtime role name 'Payments-RT'"),
        (["--audit-role", "a" * 64], f"invalid audit role name '{'a' * 64}'"),
        (["--runtime-role", "x", "--audit-role", "x"], "runtime_role and audit_role are both"),
        (["--status", "--runtime-role", "x"], "--runtime-role and --audit-role go with"),
    ],
)
def test_bad_role_names_are_bad_usage_before_connecting(args: list[str], says: str) -> None:
    done = run_cli("migrate", *args, dsn="postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"dedup migrate: {says}"), done.stderr


async def test_a_derived_role_name_over_the_limit_is_refused_and_nothing_is_written(
    pool: Any,
) -> None:
    schema = "s" * 50  # with the database's name and "_runtime": over 63 bytes
    with pytest.raises(dedup.ConfigurationError, match="over Postgres' limit of 63") as caught:
        await dedup.migrate(pool, schema=schema)
    assert "--runtime-role" in str(caught.value)
    assert await pool.fetchval("SELECT to_regnamespace($1)", schema) is None


# --- upgrading a schema migrated by dedup 0.2.0, and the docs ------------------------

# What 0003_roles.sql granted through dedup 0.2.0 (its grants, as it ran them).
LEGACY_GRANTS = """
DO $legacy$ BEGIN
    CREATE ROLE dedup_runtime NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $legacy$;
DO $legacy$ BEGIN
    CREATE ROLE dedup_audit NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $legacy$;
GRANT USAGE ON SCHEMA {schema} TO dedup_runtime, dedup_audit;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO dedup_runtime;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO dedup_runtime;
REVOKE UPDATE, DELETE ON {schema}.events FROM dedup_runtime;
REVOKE INSERT, UPDATE, DELETE ON {schema}.migrations FROM dedup_runtime;
ALTER DEFAULT PRIVILEGES IN SCHEMA {schema}
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO dedup_runtime;
ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT USAGE, SELECT ON SEQUENCES TO dedup_runtime;
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO dedup_audit;
ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT ON TABLES TO dedup_audit;
"""


async def _as_of_0_2_0(dsn: str, tmp_path: Path) -> None:
    """The schema ``dedup`` of ``dsn`` as dedup 0.2.0 left it: 0001-0003, shared roles granted."""
    old = tmp_path / "migrations-0.2.0"
    old.mkdir()
    for m in migrations.discover(migrations.sql.migrations_dir()):
        if m.version < 4:
            (old / m.path.name).write_text(m.path.read_text())
    await dedup.migrate(dsn, directory=old)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(LEGACY_GRANTS.format(schema="dedup"))
    finally:
        await conn.close()


async def test_upgrading_keeps_the_shared_roles_working_and_adds_the_schemas_own(
    new_database: NewDatabase, tmp_path: Path, login_as: LoginAs
) -> None:
    dsn = await new_database()
    await _as_of_0_2_0(dsn, tmp_path)
    done = run_cli("migrate", dsn=dsn)
    assert done.returncode == 0, done.stderr
    database = urlsplit(dsn).path[1:]
    assert done.stdout == (
        "applied dedup/0004_schema_roles.sql\n"
        "applied dedup/0005_partition_starts.sql\n"
        "applied dedup/0006_schedules.sql\n"
        "applied dedup/0007_task_steps.sql\n"
        "applied dedup/0008_outbox.sql\n"
        "applied dedup/0009_task_durations.sql\n"
        "applied dedup/0010_outbox_kafka.sql\n"
        "applied dedup/0011_outbox_http.sql\n"
        f"schema dedup: its tables are granted to runtime role {database}_dedup_runtime and "
        f"audit role {database}_dedup_audit\n"
        "schema dedup is up to date (8 applied now)\n"
    )
    conn = await asyncpg.connect(dsn)
    try:
        for role in ("dedup_runtime", f"{database}_dedup_runtime"):
            # A service logged in through either keeps (or gets) its tables.
            assert (await _privileges(conn, role))["processed"] == RUNTIME_PRIVILEGES, role
            assert (await _privileges(conn, role))["events"] == {"SELECT", "INSERT"}, role
    finally:
        await conn.close()


async def test_the_least_privilege_section_runs_as_written(
    new_database: NewDatabase, bootstrap_servers: str, tmp_path: Path
) -> None:
    """Its blocks in page order on a new database (the page's ``shop``); the roles it makes,
    cluster-wide, get names of this test's own, in the commands and in what they print."""
    dsn = await new_database()
    await _as_of_0_2_0(dsn, tmp_path)  # for the section's move off the shared roles
    parts = urlsplit(dsn)
    text = docs_support.section(AUDIT_PAGE.read_text(encoding="utf-8"), docs_support.AUDIT_ROLES)
    found = docs_support.checked_snippets(AUDIT_PAGE.name, text)
    assert [language for language, _ in found] == ["console", "sql", "console", "sql"]
    suffix = uuid.uuid4().hex[:6]
    page_roles = re.compile(r"\b((?:payments|refunds)_(?:runtime|audit|consumer)|finance_audit)\b")

    def ours(body: str) -> str:
        return page_roles.sub(lambda m: f"{m[1]}_{suffix}", body)

    made: list[str] = []
    env = docs_support.shell_env(dsn, bootstrap_servers)
    conn = await asyncpg.connect(dsn)
    try:
        for language, body in found:
            body = ours(body)
            if language == "sql":
                await conn.execute(body)
                made += re.findall(r"CREATE ROLE (\w+) LOGIN", body)
                for user, groups in re.findall(
                    r"CREATE ROLE (\w+) LOGIN .*? IN ROLE ([\w, ]+)", body
                ):
                    for group in groups.split(", "):
                        assert await conn.fetchval(
                            "SELECT pg_has_role($1, $2, 'MEMBER')", user, group
                        )
                if made and "PAYMENTS_DSN" not in env:
                    (password,) = set(re.findall(r"PASSWORD '([^']+)'", body))
                    login = (
                        f"payments_consumer_{suffix}:{password}@{parts.netloc.rpartition('@')[2]}"
                    )
                    env["PAYMENTS_DSN"] = urlunsplit(parts._replace(netloc=login))
                continue
            for command, expected in docs_support.console(body):
                actual = docs_support.run(command, env)
                assert docs_support.expected_pattern(expected + "\n").fullmatch(actual), (
                    f"`{command}` printed:\n{actual}\nthe page says:\n{expected}"
                )
        # The move off the shared roles left them nothing in this database.
        for legacy in ("dedup_runtime", "dedup_audit"):
            assert await _privileges(conn, legacy) == {}
            assert not await conn.fetchval(
                "SELECT has_schema_privilege($1, 'dedup', 'USAGE')", legacy
            )
        assert not await conn.fetchval(
            "SELECT count(*) FROM pg_default_acl, aclexplode(defaclacl) a"
            " WHERE defaclnamespace = 'dedup'::regnamespace"
            "   AND a.grantee IN ('dedup_runtime'::regrole, 'dedup_audit'::regrole)"
        )
    finally:
        groups = [
            f"{app}_{kind}_{suffix}"
            for app in ("payments", "refunds")
            for kind in ("runtime", "audit")
        ]
        existing = [
            r["rolname"]
            for r in await conn.fetch(
                "SELECT rolname FROM pg_roles WHERE rolname = ANY($1)", [*made, *groups]
            )
        ]
        if existing:
            quoted = ", ".join(f'"{r}"' for r in existing)
            await conn.execute(f"DROP OWNED BY {quoted}; DROP ROLE {quoted}")
        await conn.close()
