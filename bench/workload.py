"""The input every arm consumes, the business writes every arm makes, and the check of them.

One topic is filled once per run; each arm then reads all of it with a fresh
consumer group into a fresh database, so every arm sees the same bytes in the
same order.  The business effect is the same everywhere: one row in
``effects`` per distinct key and a per-account running sum in ``accounts``.

The hot-row arms read a topic of their own: payments on only
:data:`HOT_ACCOUNTS` accounts, applied by the README's per-message handler
(update the account's balance, insert the payment row), so concurrent
transactions lock the same rows in no particular order.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import orjson
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from dedup_dev import kafka

ACCOUNTS = 1000
"""Distinct accounts the aggregate is kept for."""
HOT_ACCOUNTS = 100
"""Accounts of the hot-row topic: every batch of 500 payments touches nearly all of them."""

# The business tables of every arm.  `effects` has no unique constraint on
# purpose: a duplicate that got through must show up in the check, not be
# swallowed by the table.
BUSINESS_DDL = """
CREATE TABLE effects (
    key        text        NOT NULL,
    account    text        NOT NULL,
    amount     bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE accounts (
    account text   PRIMARY KEY,
    total   bigint NOT NULL,
    n       bigint NOT NULL
);
"""

# Per message (naive, dedup_per_message).
EFFECT_ONE = "INSERT INTO effects (key, account, amount) VALUES ($1, $2, $3)"
ACCOUNT_ONE = """
INSERT INTO accounts (account, total, n) VALUES ($1, $2, 1)
ON CONFLICT (account) DO UPDATE
SET total = accounts.total + excluded.total, n = accounts.n + excluded.n
"""

# Set-based, one statement per batch (handwritten, dedup_batch*).  Accounts are
# locked in a fixed order so concurrent batches cannot deadlock.
EFFECT_MANY = """
INSERT INTO effects (key, account, amount)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])
"""
ACCOUNT_MANY = """
INSERT INTO accounts (account, total, n)
SELECT account, sum(amount), count(*)
FROM unnest($1::text[], $2::bigint[]) AS t(account, amount)
GROUP BY account
ORDER BY account
ON CONFLICT (account) DO UPDATE
SET total = accounts.total + excluded.total, n = accounts.n + excluded.n
"""

# The hot-row arms (hot_rows, hot_rows_serial): the README's handler, one
# payment at a time, accounts updated in whatever order payments arrive.
# `payments` has no unique constraint either, for the same reason as `effects`.
HOT_DDL = """
CREATE TABLE accounts (
    id      text   PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0
);
CREATE TABLE payments (
    id      text   NOT NULL,
    account text   NOT NULL,
    amount  bigint NOT NULL
);
"""
HOT_OPEN_ACCOUNTS = "INSERT INTO accounts (id) SELECT unnest($1::text[])"
HOT_BALANCE = "UPDATE accounts SET balance = balance + $2 WHERE id = $1"
HOT_PAYMENT = "INSERT INTO payments (id, account, amount) VALUES ($1, $2, $3)"


def account_name(i: int) -> str:
    """The ``account`` field of the records: ``acct-0042``."""
    return f"acct-{i:04d}"


@dataclass(frozen=True)
class Workload:
    """What is produced to the topic, and what a correct consumer leaves behind."""

    messages: int
    """Records in the topic, duplicates included."""
    distinct: int
    """Distinct keys: the rows ``effects`` must end with."""
    totals: dict[str, int] = field(repr=False)
    """Expected ``accounts.total`` per account."""

    def as_dict(self) -> dict[str, Any]:
        """JSON form, handed to the arm subprocesses."""
        return {"messages": self.messages, "distinct": self.distinct, "totals": self.totals}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """Inverse of :meth:`as_dict`."""
        return cls(data["messages"], data["distinct"], data["totals"])


def generate(
    messages: int,
    duplicate_ratio: float = 0.1,
    seed: int = 7,
    size: int = 200,
    accounts: int = ACCOUNTS,
) -> tuple[list[tuple[bytes, bytes]], Workload]:
    """``(key, value)`` records of about ``size`` bytes of JSON, and the expected result.

    Each payment goes to one of ``accounts`` accounts, drawn at random.

    A duplicate repeats an earlier record byte for byte (a redelivery) at a
    random later position, with the same Kafka key so it lands in the same
    partition.
    """
    rng = random.Random(seed)
    n_dup = round(messages * duplicate_ratio)
    n_unique = messages - n_dup
    totals: dict[str, int] = {}
    uniques: list[tuple[bytes, bytes]] = []
    for i in range(n_unique):
        key = f"pay-{seed:02d}-{i:010d}"
        account = account_name(rng.randrange(accounts))
        amount = rng.randrange(1, 10_000)
        totals[account] = totals.get(account, 0) + amount
        body = {
            "id": key,
            "account": account,
            "amount": amount,
            "currency": "EUR",
            "created_at": "2026-01-01T00:00:00Z",
            "note": "",
        }
        pad = size - len(orjson.dumps(body))
        body["note"] = "x" * max(pad, 0)
        uniques.append((key.encode(), orjson.dumps(body)))
    # Position i for the i-th original; a copy of i goes somewhere after it.
    placed = [(float(i), rec) for i, rec in enumerate(uniques)]
    for _ in range(n_dup):
        i = rng.randrange(n_unique)
        placed.append((rng.uniform(i + 0.5, n_unique), uniques[i]))
    placed.sort(key=lambda item: item[0])
    return [rec for _, rec in placed], Workload(messages, n_unique, totals)


async def create_topic(bootstrap_servers: str, partitions: int, prefix: str = "bench") -> str:
    """A new topic with a unique name."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
    return name


async def delete_topic(bootstrap_servers: str, topic: str) -> None:
    """Delete ``topic``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def produce(
    bootstrap_servers: str, topic: str, partitions: int, records: Sequence[tuple[bytes, bytes]]
) -> dict[str, int]:
    """Send every record, in order; once the broker acknowledged all, the end offsets.

    Returns ``{partition (as a string): end offset}``: a consumer is done when
    it has applied every partition up to there.
    """
    await kafka.produce(
        bootstrap_servers, topic, records, linger_ms=20, max_batch_size=256 * 1024, acks="all"
    )
    ends = await kafka.end_offsets(bootstrap_servers, topic, partitions)
    if sum(ends.values()) != len(records):
        raise RuntimeError(f"the topic holds {sum(ends.values())} records, not {len(records)}")
    return {str(partition): end for partition, end in ends.items()}


async def _once_each(
    conn: asyncpg.Connection, table: str, key: str, expected: Workload
) -> tuple[int, list[str]]:
    """The rows of ``table``, and a problem unless it holds one per distinct ``key`` expected."""
    rows, keys = await conn.fetchrow(f"SELECT count(*), count(DISTINCT {key}) FROM {table}")
    if rows == expected.distinct and keys == expected.distinct:
        return rows, []
    return rows, [f"{table}: {rows} rows, {keys} distinct {key}s, expected {expected.distinct}"]


async def check(conn: asyncpg.Connection, expected: Workload) -> tuple[bool, str]:
    """One effect per distinct key and the expected per-account sums; ``(ok, what was found)``."""
    rows, problems = await _once_each(conn, "effects", "key", expected)
    totals = {r["account"]: r["total"] for r in await conn.fetch("SELECT * FROM accounts")}
    every = expected.totals.keys() | totals.keys()
    wrong = [a for a in every if totals.get(a) != expected.totals.get(a)]
    if wrong:
        problems.append(f"{len(wrong)} account totals differ (e.g. {sorted(wrong)[:3]})")
    if problems:
        return False, "; ".join(problems)
    return True, f"{rows} effects, {len(totals)} account totals as expected"


async def check_hot(conn: asyncpg.Connection, expected: Workload) -> tuple[bool, str]:
    """One payment row per distinct payment and every balance as expected (so their sum too)."""
    rows, problems = await _once_each(conn, "payments", "id", expected)
    balances = {r["id"]: r["balance"] for r in await conn.fetch("SELECT * FROM accounts")}
    wrong = [a for a in balances if balances[a] != expected.totals.get(a, 0)]
    if wrong or set(expected.totals) - set(balances):
        problems.append(f"{len(wrong)} balances differ (e.g. {sorted(wrong)[:3]})")
    total, want = sum(balances.values()), sum(expected.totals.values())
    if total != want:
        problems.append(f"balances sum to {total}, expected {want}")
    if problems:
        return False, "; ".join(problems)
    return True, f"{rows} payments, {len(balances)} balances summing to {total} as expected"
