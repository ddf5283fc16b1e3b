"""Client CPU of dedup's per-record hot path, step by step (issue 27): ``python -m bench.hotpath``.

Not part of the test run or of ``python -m bench``: a measurement to read while
changing the hot path.  Each figure is process CPU (``time.process_time``) per
record, in microseconds.  The machines it runs on are shared, so what is
compared takes turns: within each round every step (or variant) runs once.

``steps`` (the default, no services): what dedup does per record of a batch,
on fake ``aiokafka.structs.ConsumerRecord`` s like the benchmark's topic holds
(``{"id", "account", "amount"}``, about 80 bytes, no headers), beside what the
hand-written loop of ``bench/arms.py`` does (``_fields``: one ``orjson.loads``
and three fields), and the payload fingerprint against hashlib's others: the
best of ``--rounds`` rounds over ``--records`` records, the cost of an empty
loop over as many taken off.

``claim`` (needs Postgres, ``--dsn`` or ``DEDUP_DSN``): the client CPU of one
``fence_and_claim`` of ``--keys`` fresh keys per call (the happy path), as the
statement is today and in variants of how its arrays travel and of what it
returns: the median of ``--rounds`` rounds of ``--calls`` calls per variant.  The
tables live in a scratch schema made from migration 0001 and dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
from aiokafka.structs import ConsumerRecord

from bench import arms, workload
from dedup import _message as message_
from dedup import _store as store
from dedup import keys
from dedup.data import _sql as sql

RECORDS = 100_000
"""Records per round of ``steps``."""
ROUNDS = 5
"""Rounds of ``steps``; each figure is its best round (the least disturbed on a shared machine)."""
HASH_SIZES = (80, 2048)
"""Value sizes, in bytes, the fingerprints are measured on."""
CLAIM_KEYS = 500
"""Keys per ``fence_and_claim``: the consumer's default ``batch_size``."""
CLAIM_CALLS = 20
"""Calls per variant per round of ``claim``."""
CLAIM_ROUNDS = 5
"""Rounds of ``claim``; the median is shown.  The variants take turns call by call."""


def records(n: int, seed: int = 7) -> list[ConsumerRecord[bytes, bytes]]:
    """``n`` records as aiokafka hands them out: the benchmark's payments, no headers."""
    rng = random.Random(seed)
    found = []
    for i in range(n):
        body = {
            "id": f"pay-{uuid.UUID(int=rng.getrandbits(128))}",
            "account": workload.account_name(rng.randrange(workload.ACCOUNTS)),
            "amount": rng.randrange(1, 10_000),
        }
        value = orjson.dumps(body)
        found.append(
            ConsumerRecord(
                "payments", i % 8, i, 1_767_225_600_000 + i, 0, None, value, None, 0, len(value), ()
            )
        )
    return found


def per_record(step: Callable[[Any], object], items: Sequence[Any]) -> float:
    """Process CPU seconds per item of ``step`` over ``items``, the loop included."""
    gc.collect()
    started = time.process_time()
    for item in items:
        step(item)
    return (time.process_time() - started) / len(items)


def steps(n: int, rounds: int) -> list[tuple[str, float]]:
    """Microseconds per record of each step, the empty loop taken off."""
    recs = records(n)
    strategy = keys.json_field("id")

    def fresh() -> list[message_.Message]:
        return [message_.Message.from_record(r) for r in recs]

    def keyed() -> list[message_.Message]:
        msgs = fresh()
        for m in msgs:
            m.idempotency_key = keys.extract(strategy, m)
        return msgs

    def extract(m: message_.Message) -> None:
        m.idempotency_key = keys.extract(strategy, m)

    def handler(m: message_.Message) -> None:
        body = m.json()
        body["account"], body["amount"]  # what a handler reads

    def dedup_record(r: Any) -> None:
        m = message_.Message.from_record(r)
        m.idempotency_key = keys.extract(strategy, m)
        store.payload_hash(m.value)
        body = m.json()
        body["account"], body["amount"]

    def handwritten_record(r: Any) -> None:
        arms._fields(r.value)

    values = [r.value for r in recs]
    measures: dict[str, Callable[[], float]] = {
        "": lambda: per_record(_nothing, recs),
        "handwritten: _fields(value)": lambda: per_record(handwritten_record, recs),
        "Message.from_record": lambda: per_record(message_.Message.from_record, recs),
        'keys.extract(json_field("id")), value not decoded yet': lambda: per_record(
            extract, fresh()
        ),
        "msg.json() + 2 fields, after the key": lambda: per_record(handler, keyed()),
        "msg.json() + 2 fields, value not decoded yet": lambda: per_record(handler, fresh()),
        "payload_hash (BLAKE2b-128)": lambda: per_record(store.payload_hash, values),
        "dedup, all of the above per record": lambda: per_record(dedup_record, recs),
    }
    # The steps take turns within each round: a disturbance falls on all alike.
    found = dict.fromkeys(measures, float("inf"))
    for _ in range(rounds):
        for name, measure in measures.items():
            found[name] = min(found[name], measure())
    return [(name, (found[name] - found[""]) * 1e6) for name in measures if name]


FINGERPRINTS: dict[str, Callable[[bytes], bytes]] = {
    "blake2b-128 (today)": store.payload_hash,
    "blake2s-128": lambda v: hashlib.blake2s(v, digest_size=16).digest(),
    "md5": lambda v: hashlib.md5(v, usedforsecurity=False).digest(),
    "sha1": lambda v: hashlib.sha1(v, usedforsecurity=False).digest(),
    "sha256": lambda v: hashlib.sha256(v).digest(),
}
"""The payload fingerprint and hashlib's alternatives to it."""


def fingerprints(n: int, rounds: int) -> list[tuple[str, dict[int, float]]]:
    """Microseconds per value of each fingerprint, for each of HASH_SIZES.

    The fingerprints take turns within each round; the best round of each is kept.
    """
    rng = random.Random(11)
    by_size = {size: [rng.randbytes(size) for _ in range(n // 10)] for size in HASH_SIZES}
    steps = {"": _nothing, **FINGERPRINTS}
    found = {(name, size): float("inf") for name in steps for size in HASH_SIZES}
    for _ in range(rounds):
        for name, step in steps.items():
            for size, values in by_size.items():
                found[name, size] = min(found[name, size], per_record(step, values))
    return [
        (name, {size: (found[name, size] - found["", size]) * 1e6 for size in HASH_SIZES})
        for name in FINGERPRINTS
    ]


def _nothing(item: object) -> None:
    return None


# The claim's variants.  Each is fence_and_claim with its claim CTE's input (and,
# for one, its output) written another way; `prepare` turns the batch's keys,
# offsets and payload hashes into the variant's arguments, `sort` reads the
# rows back into the fresh keys, as dedup._store does with today's rows.

_FENCE = """WITH fence AS (
    UPDATE {schema}.partitions
       SET next_offset = :next_offset, updated_at = now()
     WHERE group_id = :group_id AND topic = :topic AND "partition" = :partition
       AND token = :token AND next_offset IS NOT DISTINCT FROM :expected
    RETURNING 1
), claim AS (
    INSERT INTO {schema}.processed AS p
        (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash)
"""
_UPSERT = """
     WHERE :token::bigint IS NULL OR EXISTS (SELECT FROM fence)
    ON CONFLICT (namespace, idempotency_key) DO UPDATE
       SET duplicates = p.duplicates + (p.payload_hash = EXCLUDED.payload_hash)::int,
           conflicts = p.conflicts + (p.payload_hash <> EXCLUDED.payload_hash)::int,
           last_duplicate_at = now()
    RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
              p.topic, p."partition", p."offset"
)
"""
_SETTINGS = """  FROM (SELECT set_config('idle_in_transaction_session_timeout',
                          coalesce(:idle_timeout_ms::text,
                                   current_setting('idle_in_transaction_session_timeout')),
                          true),
               set_config('lock_timeout',
                          coalesce(:lock_timeout_ms::text, current_setting('lock_timeout')),
                          true)) AS settings
"""
_ALL_ROWS = (
    "SELECT (SELECT count(*) FROM fence) AS fenced, claim.*\n"
    + _SETTINGS
    + "  LEFT JOIN claim ON true"
)
_TWO_COLUMNS = (
    "SELECT (SELECT count(*) FROM fence) AS fenced, claim.idempotency_key, claim.fresh\n"
    + _SETTINGS
    + "  LEFT JOIN claim ON true"
)
_SEEN_ROWS = (
    "SELECT (SELECT count(*) FROM fence) AS fenced, seen.*\n"
    + _SETTINGS
    + "  LEFT JOIN (SELECT * FROM claim WHERE NOT fresh) AS seen ON true"
)

_HANDWRITTEN = (
    "INSERT INTO {schema}.claims (key) SELECT unnest(:keys::text[])"
    " ON CONFLICT DO NOTHING RETURNING key"
)
"""bench/arms.py's CLAIM_MANY, for comparison: keys only, the fresh ones returned."""

_THREE_ARRAYS = """    SELECT :namespace, k, coalesce(t, :topic), coalesce(part, :partition),
           o, :token, h
      FROM unnest(:keys::text[], :offsets::bigint[], :hashes::bytea[],
                  :topics::text[], :partitions::int[]) AS x(k, o, h, t, part)"""
_DELTAS = """    SELECT :namespace, k, coalesce(t, :topic), coalesce(part, :partition),
           :first_offset::bigint + d, :token, h
      FROM unnest(:keys::text[], :deltas::int[], :hashes::bytea[],
                  :topics::text[], :partitions::int[]) AS x(k, d, h, t, part)"""
_OFFSETS_TEXT = """    SELECT :namespace, k, coalesce(t, :topic), coalesce(part, :partition),
           o, :token, h
      FROM unnest(:keys::text[], string_to_array(:offsets, ',')::bigint[], :hashes::bytea[],
                  :topics::text[], :partitions::int[]) AS x(k, o, h, t, part)"""
_ONE_HASH_BYTEA = """    SELECT :namespace, k, coalesce(t, :topic), coalesce(part, :partition),
           o, :token, substring(:hashes::bytea FROM n::int * 16 - 15 FOR 16)
      FROM unnest(:keys::text[], :offsets::bigint[], :topics::text[], :partitions::int[])
           WITH ORDINALITY AS x(k, o, t, part, n)"""
_KEY_AND_HASH = """    SELECT :namespace, convert_from(substring(e FROM 17), 'UTF8'),
           coalesce(t, :topic), coalesce(part, :partition), o, :token, substring(e FOR 16)
      FROM unnest(:entries::bytea[], :offsets::bigint[],
                  :topics::text[], :partitions::int[]) AS x(e, o, t, part)"""
_TEXT_ARRAYS = """    SELECT :namespace, k, coalesce(t, :topic), coalesce(part, :partition),
           o, :token, h
      FROM unnest(:keys::text::text[], :offsets::text::bigint[], :hashes::text::bytea[],
                  :topics::text[], :partitions::int[]) AS x(k, o, h, t, part)"""

Batch = tuple[list[str], list[int], list[bytes]]
"""One call's keys (sorted, as dedup sends them), offsets and payload hashes."""


def _same(batch: Batch) -> dict[str, Any]:
    keys_, offsets, hashes = batch
    return {"keys": keys_, "offsets": offsets, "hashes": hashes}


def _deltas(batch: Batch) -> dict[str, Any]:
    keys_, offsets, hashes = batch
    first = min(offsets)
    return {
        "keys": keys_,
        "first_offset": first,
        "deltas": [o - first for o in offsets],
        "hashes": hashes,
    }


def _offsets_text(batch: Batch) -> dict[str, Any]:
    keys_, offsets, hashes = batch
    return {"keys": keys_, "offsets": ",".join(map(str, offsets)), "hashes": hashes}


def _one_hash_bytea(batch: Batch) -> dict[str, Any]:
    keys_, offsets, hashes = batch
    return {"keys": keys_, "offsets": offsets, "hashes": b"".join(hashes)}


def _key_and_hash(batch: Batch) -> dict[str, Any]:
    keys_, offsets, hashes = batch
    return {
        "entries": [h + k.encode() for k, h in zip(keys_, hashes, strict=True)],
        "offsets": offsets,
    }


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _text_arrays(batch: Batch) -> dict[str, Any]:
    keys_, offsets, hashes = batch
    return {
        "keys": "{" + ",".join(map(_quoted, keys_)) + "}",
        "offsets": "{" + ",".join(map(str, offsets)) + "}",
        "hashes": "{" + ",".join(['"\\\\x' + h.hex() + '"' for h in hashes]) + "}",
    }


def _fresh_of_all(rows: Sequence[asyncpg.Record], keys_: list[str]) -> list[str]:
    return [row["idempotency_key"] for row in rows if row["fresh"]]


def _fresh_of_returned(rows: Sequence[asyncpg.Record], keys_: list[str]) -> list[str]:
    return list({row[0] for row in rows})


def _fresh_of_seen(rows: Sequence[asyncpg.Record], keys_: list[str]) -> list[str]:
    seen = {row["idempotency_key"] for row in rows if row["idempotency_key"] is not None}
    return [k for k in keys_ if k not in seen] if seen else keys_


@dataclass(frozen=True)
class Variant:
    """One way to write the claim."""

    name: str
    claim: str
    returning: str
    prepare: Callable[[Batch], dict[str, Any]]
    sort: Callable[[Sequence[asyncpg.Record], list[str]], list[str]]
    whole: bool = False
    """``claim`` is the whole statement, with no fence (the hand-written loop's)."""

    def statement(self) -> str:
        """The statement's text, with ``{schema}`` and ``:name`` parameters."""
        return self.claim if self.whole else _FENCE + self.claim + _UPSERT + self.returning


VARIANTS = (
    # dedup's own statement (Arm.call gives it its arguments): one bytea of hashes, the
    # keys' partitions as int4[], RETURNING only keys seen before.
    Variant("today: dedup's fence_and_claim", _THREE_ARRAYS, _SEEN_ROWS, _same, _fresh_of_seen),
    Variant("offsets: first + int4[] deltas", _DELTAS, _ALL_ROWS, _deltas, _fresh_of_all),
    Variant(
        "offsets: one text, split by Postgres",
        _OFFSETS_TEXT,
        _ALL_ROWS,
        _offsets_text,
        _fresh_of_all,
    ),
    Variant(
        "hashes: one bytea of 16-byte digests",
        _ONE_HASH_BYTEA,
        _ALL_ROWS,
        _one_hash_bytea,
        _fresh_of_all,
    ),
    Variant(
        "keys+hashes: one bytea[] (hash || key)",
        _KEY_AND_HASH,
        _ALL_ROWS,
        _key_and_hash,
        _fresh_of_all,
    ),
    Variant(
        "text format: three array literals", _TEXT_ARRAYS, _ALL_ROWS, _text_arrays, _fresh_of_all
    ),
    Variant(
        "today's arrays, RETURNING only keys seen before",
        _THREE_ARRAYS,
        _SEEN_ROWS,
        _same,
        _fresh_of_seen,
    ),
    Variant(
        "today's arrays, RETURNING key and fresh of all",
        _THREE_ARRAYS,
        _TWO_COLUMNS,
        _same,
        _fresh_of_all,
    ),
    Variant(
        "one bytea of hashes, RETURNING only keys seen before",
        _ONE_HASH_BYTEA,
        _SEEN_ROWS,
        _one_hash_bytea,
        _fresh_of_seen,
    ),
    Variant(
        "(hand-written loop's CLAIM_MANY: text[] in, fresh keys out)",
        _HANDWRITTEN,
        "",
        _same,
        _fresh_of_returned,
        whole=True,
    ),
)


@dataclass
class Arm:
    """A variant's statement and where its fence stands."""

    variant: Variant
    query: sql.Query
    partition: int
    next_offset: int | None = None
    cpu: float = 0.0
    wall: float = 0.0
    calls: int = 0

    async def call(self, conn: asyncpg.Connection, batch: Batch) -> None:
        """One fence_and_claim; its client CPU and wall time are added up."""
        expected, self.next_offset = self.next_offset, max(batch[1]) + 1
        started, cpu = time.perf_counter(), time.process_time()
        values = dict(
            self.variant.prepare(batch),
            namespace="hotpath",
            group_id="hotpath",
            topic="payments",
            partition=self.partition,
            next_offset=self.next_offset,
            token=1,
            expected=expected,
            idle_timeout_ms=None,
            lock_timeout_ms=None,
            topics=None,
            partitions=None,
        )
        if self.variant is VARIANTS[0]:
            values.update(_today(batch, self.partition, expected, self.next_offset))
        rows = await self.query.fetch(conn, **{name: values[name] for name in self.query.params})
        fresh = self.variant.sort(rows, batch[0])
        self.cpu += time.process_time() - cpu
        self.wall += time.perf_counter() - started
        self.calls += 1
        fenced = self.variant.whole or rows[0]["fenced"] in (1, [1])  # a count; today's: [1]
        if not fenced or len(fresh) != len(batch[0]):
            raise RuntimeError(f"{self.variant.name}: the fence or the claim did not hold")


def _today(batch: Batch, partition: int, expected: int | None, next_offset: int) -> dict[str, Any]:
    """dedup's own fence_and_claim's arguments for one partition's turn (dedup._store)."""
    keys_, offsets, hashes = batch
    return {
        "topics": ["payments"],
        "partitions": [partition],
        "tokens": [1],
        "expected": [expected],
        "next_offsets": [next_offset],
        "keys": keys_,
        "offsets": offsets,
        "hashes": b"".join(hashes),
        "parts": [1] * len(keys_),
        "idle_timeout_ms": "60000",
    }


def _query(name: str, text: str, schema: str) -> sql.Query:
    rendered, params = sql.positional(sql.render(text, schema))
    return sql.Query(name, rendered, params)


def _batches(n: int, size: int, start: int) -> Iterator[Batch]:
    """``n`` batches of ``size`` fresh keys; offsets from ``start``, a gap now and then."""
    offset = start
    for _ in range(n):
        found = []
        for _ in range(size):
            key = f"pay-{uuid.uuid4()}"
            found.append((key, offset, store.payload_hash(key.encode())))
            offset += 2 if offset % 97 == 0 else 1
        found.sort()
        yield [k for k, _, _ in found], [o for _, o, _ in found], [h for _, _, h in found]


async def claim(dsn: str, size: int, calls: int, rounds: int) -> list[tuple[str, float, float]]:
    """Microseconds of client CPU per key and milliseconds of wall time per call, per variant."""
    schema = f"hotpath_{os.getpid()}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE SCHEMA {sql.quote(schema)}")
        core = (sql.migrations_dir() / "0001_core.sql").read_text(encoding="utf-8")
        await conn.execute(sql.render(core, schema))
        await conn.execute(f"CREATE TABLE {sql.quote(schema)}.claims (key text PRIMARY KEY)")
        arms_ = [
            Arm(v, _query(f"claim_{i}", v.statement(), schema), i) for i, v in enumerate(VARIANTS)
        ]
        # Today's statement is dedup's own, word for word.
        arms_[0].query = sql.Queries(schema).fence_and_claim
        await conn.executemany(
            f"INSERT INTO {sql.quote(schema)}.partitions"
            ' (group_id, topic, "partition", holder, token)'
            " VALUES ('hotpath', 'payments', $1, 'hotpath', 1)",
            [(a.partition,) for a in arms_],
        )
        for arm in arms_:  # warm up: prepare the statement, then start counting
            for batch in _batches(2, size, 0):
                await arm.call(conn, batch)
            arm.cpu = arm.wall = arm.calls = 0
        per_round: dict[str, list[tuple[float, float]]] = {a.variant.name: [] for a in arms_}
        for _ in range(rounds):
            before = [(arm.cpu, arm.wall, arm.calls) for arm in arms_]
            gc.collect()
            # Call by call in turn: a disturbance of the shared machine falls on all alike.
            for _ in range(calls):
                for arm in arms_:
                    await arm.call(conn, next(_batches(1, size, arm.next_offset or 0)))
            for arm, (cpu, wall, done) in zip(arms_, before, strict=True):
                n = arm.calls - done
                per_round[arm.variant.name].append(((arm.cpu - cpu) / n, (arm.wall - wall) / n))
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {sql.quote(schema)} CASCADE")
        await conn.close()
    return [
        (
            name,
            statistics.median(c for c, _ in found) / size * 1e6,
            statistics.median(w for _, w in found) * 1e3,
        )
        for name, found in per_round.items()
    ]


def show_steps(n: int, rounds: int) -> None:
    """Print the steps and the fingerprints."""
    print(
        f"client CPU per record, µs (best of {rounds} rounds of {n} records, empty loop taken off)"
    )
    figures = steps(n, rounds)
    width = max(len(name) for name, _ in figures)
    handwritten = figures[0][1]
    for name, us in figures:
        print(f"  {name:<{width}}  {us:6.3f}  ({us / handwritten:4.2f}x _fields)")
    print(f"\nfingerprint per value, µs (best of {rounds} rounds of {n // 10} values)")
    print(f"  {'':<20}" + "".join(f"{size:>8} B" for size in HASH_SIZES))
    for name, by_size in fingerprints(n, rounds):
        print(f"  {name:<20}" + "".join(f"{by_size[size]:10.3f}" for size in HASH_SIZES))


def show_claim(dsn: str, size: int, calls: int, rounds: int) -> None:
    """Print the claim's variants."""
    print(f"fence_and_claim of {size} fresh keys: client CPU per key, µs, and wall ms per call")
    print(f"(median of {rounds} rounds of {calls} calls per variant, the variants taking turns)")
    figures = asyncio.run(claim(dsn, size, calls, rounds))
    width = max(len(name) for name, _, _ in figures)
    for name, us, ms in figures:
        cpu_ms = us * size / 1e3
        print(f"  {name:<{width}}  {us:6.3f} µs/key  {cpu_ms:6.3f} ms CPU/call  {ms:6.2f} ms wall")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hotpath", description=__doc__.split("\n")[0]
    )
    parser.add_argument("what", nargs="?", choices=("steps", "claim"), default="steps")
    parser.add_argument("--records", type=int, default=RECORDS, help="records per round of steps")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per figure")
    parser.add_argument(
        "--dsn", default=os.environ.get("DEDUP_DSN"), help="for claim (default: DEDUP_DSN)"
    )
    parser.add_argument("--keys", type=int, default=CLAIM_KEYS, help="keys per fence_and_claim")
    parser.add_argument(
        "--calls", type=int, default=CLAIM_CALLS, help="calls per variant per round"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.hotpath [steps|claim]``: print the figures."""
    args = parse(argv)
    if args.what == "steps":
        show_steps(args.records, args.rounds or ROUNDS)
        return 0
    if not args.dsn:
        sys.exit("claim needs Postgres: --dsn or DEDUP_DSN")
    show_claim(args.dsn, args.keys, args.calls, args.rounds or CLAIM_ROUNDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
