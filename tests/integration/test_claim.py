"""``dedup.claim``: exactly once inside the caller's own transaction (asyncpg or SQLAlchemy).

The claims commit or roll back with the caller's writes; duplicates, conflicts
and records without a key leave the rows the consumer leaves for the same
records; outside a transaction it refuses to run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

import dedup
from dedup_dev import rows

KEY = dedup.keys.json_field("id")


def record(offset: int, value: dict[str, Any], partition: int = 0) -> Any:
    return rows.record("t", offset, value, partition)


def where(msgs: list[dedup.Message]) -> list[tuple[int, int]]:
    return [(m.partition, m.offset) for m in msgs]


@pytest.fixture
async def engine(dsn: str) -> AsyncIterator[AsyncEngine]:
    made = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://", 1))
    yield made
    await made.dispose()


async def test_claim_leaves_the_rows_the_consumer_leaves_for_the_same_records(dsn: str) -> None:
    records = [record(i, v) for i, v in enumerate(rows.VALUES)]
    conn = await asyncpg.connect(dsn)  # no codecs at all
    try:
        async with conn.transaction():
            got = await dedup.claim(conn, records, namespace="pay", key=KEY)
        found = await rows.dedup_rows(conn)
    finally:
        await conn.close()
    assert (where(got.fresh), where(got.duplicates), where(got.conflicts)) == (
        [(0, 0), (0, 4)],
        [(0, 1)],
        [(0, 2)],
    )
    assert where(got.dead_lettered) == [(0, 3), (0, 2)]

    expected = rows.EXPECTED
    assert found["processed"] == [r for r in expected["processed"] if r[0] == "pay"]
    assert found["dead_letters"] == [r for r in expected["dead_letters"] if r[0] == "pay"]
    assert found["events"] == [r for r in expected["events"] if r[2] == "pay"]


async def test_a_redelivered_batch_is_all_duplicates_and_counted_once_more(dsn: str) -> None:
    records = [record(0, {"id": "a"}), record(0, {"id": "b"}, partition=1)]
    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(2):
            async with conn.transaction():
                got = await dedup.claim(conn, records, namespace="pay", key=KEY)
        counted = await conn.fetch(
            'SELECT idempotency_key, "partition", duplicates FROM dedup.processed ORDER BY 1'
        )
        # dedup.Message works as well as a ConsumerRecord.
        async with conn.transaction():
            again = await dedup.claim(
                conn, [dedup.Message.from_record(records[0])], namespace="pay", key=KEY
            )
    finally:
        await conn.close()
    assert (got.fresh, where(got.duplicates)) == ([], [(0, 0), (1, 0)])
    assert [tuple(r) for r in counted] == [("a", 0, 1), ("b", 1, 1)]
    assert where(again.duplicates) == [(0, 0)]


async def test_a_message_whose_json_the_caller_changed_is_claimed_by_the_key_it_was_sent_with(
    dsn: str,
) -> None:
    # A caller that builds its row from msg.json() (taking the id out) before it claims.
    records = [record(0, {"id": "a", "amount": 5}), record(1, {"id": "b", "amount": 7})]
    msgs = [dedup.Message.from_record(r) for r in records]
    row = msgs[0].json()
    del row["id"]
    msgs[1].json()["id"] = "a"
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            got = await dedup.claim(conn, msgs, namespace="pay", key=KEY)
        async with conn.transaction():  # the same records, delivered again
            again = await dedup.claim(conn, records, namespace="pay", key=KEY)
        found = await rows.dedup_rows(conn)
    finally:
        await conn.close()
    assert (where(got.fresh), got.dead_lettered, got.conflicts) == ([(0, 0), (0, 1)], [], [])
    assert (again.fresh, where(again.duplicates)) == ([], [(0, 0), (0, 1)])
    assert found["processed"] == [("pay", "a", 1, 0), ("pay", "b", 1, 0)]
    assert found["dead_letters"] == []
    assert row == {"amount": 5}, "the caller's object is left as the caller made it"


async def test_a_rolled_back_transaction_takes_its_claims_with_it(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                got = await dedup.claim(conn, [record(0, {"id": "a"})], namespace="pay", key=KEY)
                assert where(got.fresh) == [(0, 0)]
                raise RuntimeError("the business write failed")
        assert await conn.fetchval("SELECT count(*) FROM dedup.processed") == 0
        async with conn.transaction():
            got = await dedup.claim(conn, [record(0, {"id": "a"})], namespace="pay", key=KEY)
        assert where(got.fresh) == [(0, 0)], "delivered again, applied then"
    finally:
        await conn.close()


async def test_session_claims_and_orm_writes_commit_or_roll_back_together(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE applied (key text PRIMARY KEY)"))

    async def apply(values: list[dict[str, Any]], fail: bool = False) -> dedup.ClaimResult:
        records = [record(i, v) for i, v in enumerate(values)]
        async with AsyncSession(engine) as session, session.begin():
            # No statement ran in this transaction yet: SQLAlchemy has not sent
            # BEGIN; the claim must still land inside it.
            got = await dedup.claim(session, records, namespace="orm", key=KEY)
            for msg in got.fresh:
                await session.execute(
                    text("INSERT INTO applied (key) VALUES (:k)"), {"k": msg.idempotency_key}
                )
            if fail:
                raise RuntimeError("the business write failed")
        return got

    with pytest.raises(RuntimeError):
        await apply([{"id": "a"}], fail=True)
    first = await apply([{"id": "a"}, {"id": "b"}, {"id": "b", "v": 2}])
    again = await apply([{"id": "a"}, {"id": "b"}])
    assert [m.idempotency_key for m in first.fresh] == ["a", "b"]
    assert [m.idempotency_key for m in first.conflicts] == ["b"]
    assert again.fresh == [] and len(again.duplicates) == 2
    async with engine.connect() as conn:
        applied = (await conn.execute(text("SELECT key FROM applied ORDER BY 1"))).all()
        claimed = (
            await conn.execute(
                text(
                    "SELECT idempotency_key, duplicates, conflicts FROM dedup.processed ORDER BY 1"
                )
            )
        ).all()
        conflict = (
            await conn.execute(text("SELECT detail FROM dedup.events WHERE kind = 'conflict'"))
        ).scalar_one()
    assert [tuple(r) for r in applied] == [("a",), ("b",)]
    assert [tuple(r) for r in claimed] == [("a", 1, 0), ("b", 1, 1)]
    assert conflict == {"offset": 2}, "written as text, read back by SQLAlchemy's codec"


async def test_an_sqlalchemy_connection_in_a_transaction_works_too(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        got = await dedup.claim(conn, [record(0, {"id": "a"})], namespace="orm", key=KEY)
        assert where(got.fresh) == [(0, 0)]
    async with engine.connect() as conn:
        n = (await conn.execute(text("SELECT count(*) FROM dedup.processed"))).scalar_one()
    assert n == 1


async def test_outside_a_transaction_claim_refuses_to_run(dsn: str, engine: AsyncEngine) -> None:
    records = [record(0, {"id": "a"})]
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(dedup.ConfigurationError, match=r"conn\.transaction\(\)"):
            await dedup.claim(conn, records, namespace="pay", key=KEY)
    finally:
        await conn.close()
    async with AsyncSession(engine) as session:
        with pytest.raises(dedup.ConfigurationError, match=r"session\.begin\(\)"):
            await dedup.claim(session, records, namespace="pay", key=KEY)
    async with engine.connect() as sa_conn:
        with pytest.raises(dedup.ConfigurationError, match=r"engine\.begin\(\)"):
            await dedup.claim(sa_conn, records, namespace="pay", key=KEY)
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.begin() as sa_conn:
        with pytest.raises(dedup.ConfigurationError, match="AUTOCOMMIT"):
            await dedup.claim(sa_conn, records, namespace="pay", key=KEY)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        with pytest.raises(dedup.ConfigurationError, match="expected an asyncpg connection"):
            await dedup.claim(pool, records, namespace="pay", key=KEY)
    finally:
        await pool.close()
    async with engine.connect() as sa_conn:
        n = (await sa_conn.execute(text("SELECT count(*) FROM dedup.processed"))).scalar_one()
    assert n == 0, "nothing was claimed by a refused call"
