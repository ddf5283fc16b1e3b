"""``dedup.testing.deliver``: a handler run over records the consumer's way, on real Postgres.

No Kafka: each record goes through ``dedup.claim`` and the handler in one
transaction, and the test reads what a user would, the rows the handler and
dedup left and each record's outcome.  A handler that is not idempotent by
itself (a balance update) shows one effect for three copies; a redelivery is a
duplicate; a conflicting copy is a conflict with its dead letter; a record the
handler fails on is dead-lettered after ``max_attempts`` with its error, in a
batch or alone; a record without a key follows ``on_missing_key``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import orjson
import pytest

import dedup
from dedup.testing import deliver, record
from dedup_dev import rows

PROCESSED, DUPLICATE, CONFLICT, DEAD_LETTERED = (
    dedup.Outcome.PROCESSED,
    dedup.Outcome.DUPLICATE,
    dedup.Outcome.CONFLICT,
    dedup.Outcome.DEAD_LETTERED,
)
KEY = dedup.keys.json_field("payment_id")
PAYMENT = {"payment_id": "p-1", "account": "a", "amount": 25}


@pytest.fixture
async def accounts(pool: Any) -> Any:
    """The account ``a`` at 100."""
    await pool.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance integer NOT NULL)")
    await pool.execute("INSERT INTO accounts VALUES ('a', 100)")
    return pool


async def pay(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Not idempotent by itself: every call takes the amount off."""
    payment = msg.json()
    await tx.conn.execute(
        "UPDATE accounts SET balance = balance - $2 WHERE id = $1",
        payment["account"],
        payment["amount"],
    )


async def balance(pool: Any) -> int:
    return int(await pool.fetchval("SELECT balance FROM accounts WHERE id = 'a'"))


async def test_three_copies_of_a_balance_update_take_the_amount_off_once(
    dsn: str, accounts: Any
) -> None:
    delivery = await deliver(pay, [PAYMENT, PAYMENT, PAYMENT], dsn=dsn, namespace="pay", key=KEY)
    assert delivery.outcomes == [PROCESSED, DUPLICATE, DUPLICATE]
    assert delivery.counts == {PROCESSED: 1, DUPLICATE: 2, CONFLICT: 0, DEAD_LETTERED: 0}
    assert await balance(accounts) == 75
    # Three records a producer sent: offsets 0, 1, 2 of partition 0 of topic "test".
    assert [m.where for m in delivery.messages] == ["test:0:0", "test:0:1", "test:0:2"]
    assert [m.idempotency_key for m in delivery.messages] == ["p-1"] * 3
    row = await accounts.fetchrow(
        'SELECT topic, "partition", "offset", duplicates, token FROM dedup.processed'
    )
    assert tuple(row) == ("test", 0, 0, 2, None)  # no partition lease, no token


async def test_the_same_records_again_are_redelivered_where_they_sat(
    pool: Any, accounts: Any
) -> None:
    first = await deliver(pay, [PAYMENT], pool=pool, namespace="pay", key=KEY)
    again = await deliver(pay, first.messages, pool=pool, namespace="pay", key=KEY)
    placed = record(PAYMENT, topic="payments", partition=3, offset=41)
    twice = await deliver(pay, [placed, placed], pool=pool, namespace="pay", key=KEY)
    assert (first.outcomes, again.outcomes, twice.outcomes) == (
        [PROCESSED],
        [DUPLICATE],
        [DUPLICATE, DUPLICATE],
    )
    assert [m.where for m in again.messages] == ["test:0:0"]
    assert [m.where for m in twice.messages] == ["payments:3:41", "payments:3:41"]
    assert await balance(accounts) == 75
    assert await pool.fetchval("SELECT duplicates FROM dedup.processed") == 3


async def test_deliver_leaves_the_rows_the_consumer_leaves_for_the_same_records(
    dsn: str,
) -> None:
    async def handle(msg: dedup.Message, tx: dedup.Tx) -> None:
        return None

    delivery = await deliver(
        handle, rows.VALUES, dsn=dsn, namespace="pay", key=dedup.keys.json_field("id")
    )
    assert delivery.outcomes == [PROCESSED, DUPLICATE, CONFLICT, DEAD_LETTERED, PROCESSED]
    conn = await asyncpg.connect(dsn)
    try:
        found = await rows.dedup_rows(conn)
    finally:
        await conn.close()
    expected = rows.EXPECTED
    assert found["processed"] == [r for r in expected["processed"] if r[0] == "pay"]
    assert found["dead_letters"] == [r for r in expected["dead_letters"] if r[0] == "pay"]
    assert found["events"] == [r for r in expected["events"] if r[2] == "pay"]


async def test_a_conflicting_copy_is_a_conflict_dead_lettered_or_only_recorded(
    pool: Any, accounts: Any
) -> None:
    other = {**PAYMENT, "amount": 99}
    lettered = await deliver(pay, [PAYMENT, other], pool=pool, namespace="pay", key=KEY)
    recorded = await deliver(
        pay, [other], pool=pool, namespace="pay", key=KEY, on_conflict="record"
    )
    assert (lettered.outcomes, recorded.outcomes) == ([PROCESSED, CONFLICT], [CONFLICT])
    assert await balance(accounts) == 75
    dead = await pool.fetch('SELECT "offset", reason, value FROM dedup.dead_letters')
    assert [(r["offset"], orjson.loads(r["value"])) for r in dead] == [(1, other)]
    assert dead[0]["reason"] == (
        "conflict: key 'p-1' was applied from test:0:0 with a different payload"
    )
    assert await pool.fetchval("SELECT conflicts FROM dedup.processed") == 2


class Poisoned:
    """``pay``, which raises on the payment ``poison`` and counts its calls per payment."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def __call__(self, msg: dedup.Message, tx: dedup.Tx) -> None:
        payment = msg.json()
        self.calls[payment["payment_id"]] = self.calls.get(payment["payment_id"], 0) + 1
        await pay(msg, tx)
        if payment["payment_id"] == "poison":
            raise ValueError(f"cannot apply {payment['payment_id']}")


def payments(*ids: str) -> list[dict[str, Any]]:
    return [{"payment_id": i, "account": "a", "amount": 1} for i in ids]


async def test_a_record_the_handler_fails_on_is_dead_lettered_after_max_attempts(
    pool: Any, accounts: Any
) -> None:
    handler = Poisoned()
    delivery = await deliver(
        handler, payments("p-1", "poison", "p-2"), pool=pool, namespace="pay", key=KEY
    )
    assert delivery.outcomes == [PROCESSED, DEAD_LETTERED, PROCESSED]
    assert delivery[1].error == "ValueError: cannot apply poison"
    assert delivery[0].error is None
    assert handler.calls == {"p-1": 1, "poison": 3, "p-2": 1}  # max_attempts=3
    assert await balance(accounts) == 98  # the poison's three attempts all rolled back
    dead = await pool.fetchrow(
        "SELECT idempotency_key, reason, error, attempts, token FROM dedup.dead_letters"
    )
    assert tuple(dead) == (
        "poison",
        "handler failed 3 times",
        "ValueError: cannot apply poison",
        3,
        None,
    )
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 2
    # Not claimed: once the handler is fixed, the record applies.
    fixed = await deliver(pay, delivery.messages[1:2], pool=pool, namespace="pay", key=KEY)
    assert fixed.outcomes == [PROCESSED]


async def test_in_a_batch_the_failing_message_is_isolated_as_the_consumer_isolates_it(
    pool: Any, accounts: Any
) -> None:
    handler = Poisoned()
    ids = ("p-1", "p-2", "poison", "p-3", "p-4")
    delivery = await deliver(
        handler, payments(*ids), pool=pool, namespace="pay", key=KEY, batch_size=5, max_attempts=2
    )
    assert delivery.outcomes == [PROCESSED, PROCESSED, DEAD_LETTERED, PROCESSED, PROCESSED]
    # The batch ran to the poison, then around it: before it, it alone (twice), after it.
    assert handler.calls == {"p-1": 2, "p-2": 2, "poison": 3, "p-3": 1, "p-4": 1}
    assert await balance(accounts) == 96
    assert await pool.fetchval("SELECT reason FROM dedup.dead_letters") == "handler failed 2 times"


async def test_a_batch_handler_gets_the_fresh_messages_and_is_split_in_halves(
    pool: Any, accounts: Any
) -> None:
    seen: list[list[str]] = []

    async def pay_all(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        ids = [m.json()["payment_id"] for m in msgs]
        seen.append(ids)
        if "poison" in ids:
            raise ValueError("a poison payment in the batch")
        await tx.conn.executemany(
            "UPDATE accounts SET balance = balance - $2 WHERE id = $1",
            [(m.json()["account"], m.json()["amount"]) for m in msgs],
        )

    batch = [*payments("p-1", "p-1", "p-2", "poison"), *payments("p-3")]
    delivery = await deliver(
        pay_all, batch, pool=pool, namespace="pay", key=KEY, batch_size=5, max_attempts=2
    )
    assert delivery.outcomes == [PROCESSED, DUPLICATE, PROCESSED, DEAD_LETTERED, PROCESSED]
    assert seen == [
        ["p-1", "p-2", "poison", "p-3"],  # the copy of p-1 claimed away
        ["p-1"],  # the first half: p-1 and its copy
        ["p-2", "poison", "p-3"],
        ["p-2"],
        ["poison", "p-3"],
        ["poison"],
        ["poison"],
        ["p-3"],
    ]
    assert await balance(accounts) == 97


async def test_a_record_without_a_key_follows_on_missing_key(pool: Any, accounts: Any) -> None:
    keyless = {"account": "a", "amount": 5}
    lettered = await deliver(pay, [keyless], pool=pool, namespace="pay", key=KEY)
    keyed = await deliver(
        pay, [record(keyless, offset=1)], pool=pool, namespace="pay", key=KEY,
        on_missing_key="offset",
    )  # fmt: skip
    assert (lettered.outcomes, keyed.outcomes) == ([DEAD_LETTERED], [PROCESSED])
    assert keyed[0].msg.idempotency_key == "test:0:1"
    assert await balance(accounts) == 95
    assert await pool.fetchval("SELECT reason FROM dedup.dead_letters") == (
        "no idempotency key: missing key field 'payment_id'"
    )


async def test_records_carry_their_key_headers_and_tombstone(pool: Any) -> None:
    seen: list[dedup.Message] = []

    async def keep(msg: dedup.Message, tx: dedup.Tx) -> None:
        seen.append(msg)

    made = [
        record(b"raw", key="k-1", headers={"h": "v"}, timestamp=1_700_000_000_000),
        record(None, key=b"k-2", headers=[("h", b"1"), ("h", None)]),
        "text",  # no key at all: dead-lettered under the default key
    ]
    delivery = await deliver(keep, made, pool=pool, namespace="kept")
    assert delivery.outcomes == [PROCESSED, PROCESSED, DEAD_LETTERED]
    first, tombstone = seen
    assert (first.key, first.value, first.headers, first.timestamp) == (
        b"k-1",
        b"raw",
        {"h": b"v"},
        1_700_000_000_000,
    )
    assert (tombstone.value, tombstone.tombstone, tombstone.raw_headers) == (
        b"",
        True,
        (("h", b"1"), ("h", None)),
    )
    assert [m.offset for m in delivery.messages] == [0, 1, 2]


async def test_a_handler_that_leaves_the_transaction_aborted_fails_as_in_the_consumer(
    pool: Any,
) -> None:
    async def swallow(msg: dedup.Message, tx: dedup.Tx) -> None:
        try:
            await tx.conn.execute("SELECT 1 / 0")
        except asyncpg.DivisionByZeroError:
            pass  # the transaction stays aborted

    delivery = await deliver(swallow, ["x"], pool=pool, namespace="n", key=dedup.keys.offset())
    assert delivery.outcomes == [DEAD_LETTERED]
    assert delivery[0].error is not None
    assert delivery[0].error.startswith("HandlerError: the transaction was aborted")
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0


async def test_a_handler_past_its_timeout_is_cancelled_and_fails_as_in_the_consumer(
    pool: Any,
) -> None:
    async def hang(msg: dedup.Message, tx: dedup.Tx) -> None:
        await asyncio.Event().wait()  # never set

    delivery = await deliver(
        hang, ["x"], pool=pool, namespace="n", key=dedup.keys.offset(), handler_timeout=0.05
    )
    assert delivery.outcomes == [DEAD_LETTERED]
    assert delivery[0].error == (
        "HandlerError: the handler did not finish within handler_timeout=0.05s; it was cancelled"
    )


async def test_a_lost_connection_is_raised_not_dead_lettered(dsn: str) -> None:
    async def cut(msg: dedup.Message, tx: dedup.Tx) -> None:
        await tx.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    with pytest.raises(asyncpg.ConnectionDoesNotExistError, match="administrator command"):
        await deliver(cut, ["x"], dsn=dsn, namespace="n", key=dedup.keys.offset())
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    finally:
        await conn.close()


async def test_bad_arguments_are_refused_naming_them(dsn: str, new_database: Any) -> None:
    async def ok(msg: dedup.Message, tx: dedup.Tx) -> None:
        return None

    def sync(msg: dedup.Message, tx: dedup.Tx) -> None:
        return None

    cases: list[tuple[Any, dict[str, Any], str]] = [
        (PAYMENT, {}, "records={'payment_id': 'p-1', "),
        ([object()], {}, "records[0]: record value <object object at "),
        (["x"], {"batch_size": 0}, "batch_size=0: expected a whole number from 1 to 100000"),
        (["x"], {"namespace": ""}, "namespace must not be empty"),
        (["x"], {"pool": object()}, "pass exactly one of dsn= or pool="),
    ]
    for records, options, error in cases:
        with pytest.raises(dedup.ConfigurationError) as refused:
            await deliver(ok, records, **{"dsn": dsn, "namespace": "n", **options})
        assert str(refused.value).startswith(error), (options, refused.value)
    with pytest.raises(dedup.ConfigurationError, match="is a function that is not async"):
        await deliver(sync, ["x"], dsn=dsn, namespace="n")
    with pytest.raises(dedup.ConfigurationError, match="no dedup tables in schema 'dedup'"):
        await deliver(ok, ["x"], dsn=await new_database(), namespace="n")
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            with pytest.raises(dedup.ConfigurationError, match="outside a transaction"):
                await deliver(ok, ["x"], pool=conn, namespace="n")
    finally:
        await conn.close()
