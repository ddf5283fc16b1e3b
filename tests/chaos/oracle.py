"""The oracle: after a run, check every key, every dead letter, every offset and every token.

The ground truth is the topic itself, read back from the broker after the run
(not what the producer meant to send: a producer retry during a broker restart
may have written a record twice, and that copy must be handled like any other).
The database is read as users see it.  Checks, for a consumer run:

1. every plain key has exactly one business effect (``chaos_effects`` row):
   none is **lost**, none **doubled**, none appears that was never sent;
2. ``dedup.processed`` holds exactly the keys of the business rows, each at the
   same partition, offset and token as its effect;
3. every copy is accounted for once per pass over the topic: for each key,
   1 + duplicates + conflicts = the records carrying it (times the passes);
4. the dead letters are exactly the poison records (bad JSON, no key field,
   handler bug, conflicting payload, a handler that hangs), each with its whole
   record (key, value, headers in order) and a reason of the right kind; a
   record whose handler hangs was cancelled at ``handler_timeout`` (the dead
   letter's error says so) and tried ``max_attempts`` times at least (its
   ``chaos_hangs`` rows) before it was dead-lettered, never counted as lost;
5. offsets: at the end every partition's ``next_offset`` is the end of the
   partition; in every snapshot taken during the run (one transaction each),
   every record below ``next_offset`` is applied, a duplicate, or dead-lettered,
   and none at or above it is applied (in the first pass: a replay moves the
   offset back on purpose);
6. tokens: every committed batch (``chaos_batches``) and every business row was
   written under the token that owned its partition when it committed: the
   ``partition_acquired`` events are the token history, and commit timestamps
   (``track_commit_timestamp``) order each write against it.  A write committed
   after a newer token's acquisition is a **stale write committed**.
7. hot rows (``accounts``): each account's balance is the sum of the amounts of
   the effects applied to it, so no handler's update was lost, doubled or left
   behind by a batch that rolled back.

For a task run: each business key's job effect exists once, twice for the key
of the forced rerun, whose run is in ``events`` as forced; every effect was
written under the lease token current at its commit; every task ends succeeded.
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiokafka
import orjson
from aiokafka.structs import TopicPartition

from dedup.data import _sql as sql
from tests.chaos import scenarios

EXAMPLES = 5
MAX_ATTEMPTS = 3
"""The consumer's ``max_attempts`` (its default, which the children keep)."""
MAX_PARTITIONS = max(
    size.partitions for scenario in scenarios.SCENARIOS.values() for size in scenario.sizes.values()
)
"""No scenario's topic has more: the partitions a snapshot looks up."""


@dataclass(frozen=True)
class Record:
    """One record of the topic, as read back."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    kind: str
    """plain, conflict, bad_json, no_key, explode or hang (see :func:`scenarios.classify`)."""
    ident: str | None
    """Its idempotency key, when it has one."""


async def read_topic(bootstrap_servers: str, topic: str, partitions: int) -> list[Record]:
    """Every record of ``topic``, from the beginning to the current end."""
    consumer = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list[Record] = []

        async def behind() -> bool:
            for tp in tps:
                if await consumer.position(tp) < end[tp]:
                    return True
            return False

        while await behind():
            fetched = await consumer.getmany(timeout_ms=1000)
            for tp, records in fetched.items():
                for r in records:
                    if r.offset >= end[tp]:
                        continue
                    kind, ident = scenarios.classify(r.value or b"")
                    out.append(
                        Record(
                            r.partition,
                            r.offset,
                            r.key,
                            r.value or b"",
                            tuple(r.headers or ()),
                            kind,
                            ident,
                        )
                    )
        return sorted(out, key=lambda r: (r.partition, r.offset))
    finally:
        await consumer.stop()


@dataclass
class Snapshot:
    """The committed state at one moment (one repeatable-read transaction)."""

    label: str
    first_pass: bool
    offsets: dict[int, int | None]
    effect_keys: set[str]
    effect_at: set[tuple[int, int]]
    dead: set[tuple[int, int]]


async def snapshot(conn: Any, group: str, topic: str, label: str, *, first_pass: bool) -> Snapshot:
    """Read offsets, business rows and dead letters in one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        # The library's own query, so the oracle reads positions as the consumer does.
        positions = sql.Queries().partition_position
        offsets = {}
        for partition in range(MAX_PARTITIONS):
            row = await positions.fetchrow(conn, group_id=group, topic=topic, partition=partition)
            if row is not None:
                offsets[partition] = row["next_offset"]
        effects = await conn.fetch('SELECT key, "partition", "offset" FROM chaos_effects')
        dead = await conn.fetch(
            'SELECT "partition", "offset" FROM dedup.dead_letters WHERE topic = $1', topic
        )
    return Snapshot(
        label,
        first_pass,
        offsets,
        {r["key"] for r in effects},
        {(r["partition"], r["offset"]) for r in effects},
        {(r["partition"], r["offset"]) for r in dead},
    )


@dataclass
class Verdict:
    """What the oracle found."""

    lost: int = 0
    doubled: int = 0
    dead_lettered: int = 0
    stale_refused: int = 0
    stale_committed: int = 0
    duplicates: int = 0
    violations: list[str] = field(default_factory=list)

    def fail(self, what: str, examples: list[Any], count: int | None = None) -> None:
        n = len(examples) if count is None else count
        if n:
            shown = ", ".join(map(str, examples[:EXAMPLES]))
            more = f" (+{n - EXAMPLES} more)" if n > EXAMPLES else ""
            self.violations.append(f"{what}: {n}: {shown}{more}")


@dataclass(frozen=True)
class Acquisition:
    token: int
    holder: str
    at: dt.datetime | None


class TokenHistory:
    """Who owned each resource from when: acquisitions ordered by commit time."""

    def __init__(self, rows: list[Any]) -> None:
        self.by_resource: dict[str, list[Acquisition]] = defaultdict(list)
        for r in rows:
            self.by_resource[r["resource"]].append(Acquisition(r["token"], r["holder"], r["at"]))
        for acquisitions in self.by_resource.values():
            acquisitions.sort(key=lambda a: a.token)

    def check(self, resource: str, token: int, holder: str, at: dt.datetime | None) -> str | None:
        """None if ``token`` owned ``resource`` when the write committed at ``at``; else why not."""
        history = self.by_resource.get(resource, [])
        mine = next((a for a in history if a.token == token), None)
        if mine is None:
            return f"{resource} token {token} by {holder}: never acquired"
        if mine.holder != holder:
            return f"{resource} token {token} was acquired by {mine.holder}, written by {holder}"
        if at is None or any(a.at is None for a in history):
            return f"{resource} token {token}: no commit timestamp (track_commit_timestamp off?)"
        times = sorted((a.at, a.token) for a in history if a.at is not None)
        before = bisect.bisect_left(times, (at, -1))
        current = times[before - 1][1] if before else None
        if current != token:
            return (
                f"{resource} write by {holder} under token {token} committed at {at:%H:%M:%S.%f} "
                f"while token {current} owned it"
            )
        return None


async def check_consumer_run(
    conn: Any,
    records: list[Record],
    snapshots: list[Snapshot],
    *,
    group: str,
    topic: str,
    passes: int,
    accounts: bool = False,
) -> Verdict:
    """Checks 1-6 of the module docstring, and 7 with ``accounts``."""
    v = Verdict()
    by_key: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        if r.kind in ("plain", "conflict") and r.ident is not None:
            by_key[r.ident].append(r)
    plain = {k for k, rs in by_key.items() if any(r.kind == "plain" for r in rs)}

    # 1. one business effect per key
    effects = await conn.fetch('SELECT key, "partition", "offset", token FROM chaos_effects')
    count = Counter(e["key"] for e in effects)
    lost_keys = sorted(plain - set(count))
    v.fail("lost (a key never applied)", lost_keys)
    v.lost += len(lost_keys)
    doubled = {k: n for k, n in count.items() if n > 1}
    v.doubled = sum(n - 1 for n in doubled.values())
    v.fail("doubled (a key applied more than once)", sorted(doubled.items()), len(doubled))
    v.fail("phantom effects (never sent)", sorted(set(count) - plain))
    position = {(r.partition, r.offset): r for r in records}
    misplaced = [
        (e["key"], e["partition"], e["offset"])
        for e in effects
        if (copy := position.get((e["partition"], e["offset"]))) is None
        or copy.kind != "plain"
        or copy.ident != e["key"]
    ]
    v.fail("effects at a record that is not a plain copy of their key", misplaced)

    # 2. processed holds the same keys, where the effect came from
    processed = await conn.fetch(
        'SELECT idempotency_key, "partition", "offset", token, duplicates, conflicts'
        " FROM dedup.processed WHERE namespace = $1",
        group,
    )
    keys = {p["idempotency_key"] for p in processed}
    v.fail("keys in dedup.processed without a business row", sorted(keys - set(count)))
    v.fail("business rows without a dedup.processed key", sorted(set(count) - keys))
    effect_of = {e["key"]: e for e in effects}
    differ = [
        p["idempotency_key"]
        for p in processed
        if (e := effect_of.get(p["idempotency_key"])) is not None
        and (p["partition"], p["offset"], p["token"]) != (e["partition"], e["offset"], e["token"])
    ]
    v.fail("processed rows that disagree with their business row", differ)

    # 3. every copy counted once per pass
    v.duplicates = sum(p["duplicates"] for p in processed)
    miscounted = [
        (p["idempotency_key"], 1 + p["duplicates"] + p["conflicts"], passes * len(by_key[k]))
        for p in processed
        if 1 + p["duplicates"] + p["conflicts"] != passes * len(by_key[k := p["idempotency_key"]])
    ]
    v.fail("keys whose copies are not each counted once (key, counted, sent)", miscounted)

    # 4. dead letters: exactly the poison, whole
    dead = await conn.fetch(
        'SELECT "partition", "offset", key, value, header_names, header_values, reason, error'
        " FROM dedup.dead_letters WHERE topic = $1",
        topic,
    )
    v.dead_lettered = len(dead)
    poison = {(r.partition, r.offset): r for r in records if r.kind not in ("plain",)}
    found = {(d["partition"], d["offset"]): d for d in dead}
    missing = sorted(set(poison) - set(found))
    v.fail("poison records not dead-lettered", missing)
    v.lost += len(missing)
    v.fail("dead letters that are not poison", sorted(set(found) - set(poison)))
    reasons = {
        "conflict": "conflict",
        "bad_json": "no idempotency key",
        "no_key": "no idempotency key",
        "explode": "handler failed",
        "hang": "handler failed",
    }
    damaged: list[tuple[Any, ...]] = []
    for at, d in found.items():
        sent = poison.get(at)
        if sent is None:
            continue
        headers = tuple(zip(d["header_names"], d["header_values"], strict=True))
        if (d["key"], d["value"], headers) != (sent.key, sent.value, sent.headers):
            damaged.append((at, "record differs"))
        elif not d["reason"].startswith(reasons[sent.kind]):
            damaged.append((at, sent.kind, d["reason"][:60]))
        elif sent.kind == "hang" and "handler_timeout" not in (d["error"] or ""):
            damaged.append((at, sent.kind, (d["error"] or "")[:60]))
    v.fail("dead letters without their whole record or with a wrong reason", damaged)
    hung = [at for at, r in poison.items() if r.kind == "hang"]
    if hung:
        tries = Counter(
            (h["partition"], h["offset"])
            for h in await conn.fetch('SELECT "partition", "offset" FROM chaos_hangs')
        )
        few = [(at, tries[at]) for at in sorted(hung) if tries[at] < MAX_ATTEMPTS]
        v.fail("hung records not cancelled and retried max_attempts times (at, tries)", few)

    # 5. offsets
    ends: dict[int, int] = defaultdict(int)
    for r in records:
        ends[r.partition] = max(ends[r.partition], r.offset + 1)
    final = snapshots[-1].offsets if snapshots else {}
    short = [(p, final.get(p), end) for p, end in sorted(ends.items()) if final.get(p) != end]
    v.fail("partitions whose stored offset is not the end (partition, stored, end)", short)
    for snap in snapshots:
        behind, ahead = [], []
        for r in records:
            n = snap.offsets.get(r.partition)
            below = n is not None and r.offset < n
            if below:
                ok = (
                    r.ident in snap.effect_keys
                    if r.kind == "plain"
                    else (r.partition, r.offset) in snap.dead
                )
                if not ok:
                    ahead.append((r.partition, r.offset))
            elif snap.first_pass and (
                (r.partition, r.offset) in snap.effect_at or (r.partition, r.offset) in snap.dead
            ):
                behind.append((r.partition, r.offset))
        v.fail(f"[{snap.label}] stored offset ahead of unapplied records", ahead)
        v.fail(f"[{snap.label}] stored offset behind applied records", behind)

    # 6. tokens
    history = TokenHistory(
        await conn.fetch(
            "SELECT resource, token, holder, pg_xact_commit_timestamp(xmin) AS at"
            " FROM dedup.events WHERE kind = 'partition_acquired' AND namespace = $1",
            group,
        )
    )
    writes = await conn.fetch(
        "SELECT 'batch' AS what, \"partition\", token, holder,"
        " pg_xact_commit_timestamp(xmin) AS at FROM chaos_batches"
        " UNION ALL SELECT 'effect', \"partition\", token, holder,"
        " pg_xact_commit_timestamp(xmin) FROM chaos_effects"
    )
    stale = []
    for w in writes:
        why = history.check(f"{group}:{topic}:{w['partition']}", w["token"], w["holder"], w["at"])
        if why:
            stale.append(f"{w['what']} {why}")
    v.stale_committed = sum(1 for s in stale if s.startswith("batch"))
    v.fail("writes under a token that was not current at commit", stale)
    v.stale_refused = await conn.fetchval(
        "SELECT count(*) FROM dedup.events WHERE kind = 'stale_rejected' AND namespace = $1",
        group,
    )

    # 7. hot rows
    if accounts:
        expected: Counter[int] = Counter()
        for e in effects:
            copy = position.get((e["partition"], e["offset"]))
            if copy is not None and copy.kind == "plain":
                body = orjson.loads(copy.value)
                if "account" in body:
                    expected[body["account"]] += body["amount"]
        balances = await conn.fetch("SELECT account, balance FROM chaos_accounts ORDER BY 1")
        off = [
            (b["account"], b["balance"], expected[b["account"]])
            for b in balances
            if b["balance"] != expected[b["account"]]
        ]
        v.fail("balances that are not the sum of their applied effects (account, is, sum)", off)
    return v


async def check_task_run(conn: Any, task: str, keys: list[str], forced_key: str | None) -> Verdict:
    """Each key's job effect once (twice for the forced key, whose run is audited as forced;
    None: no forced rerun)."""
    v = Verdict()
    effects = await conn.fetch(
        "SELECT business_key, token, holder, forced, pg_xact_commit_timestamp(xmin) AS at"
        " FROM chaos_task_effects WHERE task = $1",
        task,
    )
    history = TokenHistory(
        await conn.fetch(
            "SELECT resource, token, holder, pg_xact_commit_timestamp(xmin) AS at"
            " FROM dedup.events WHERE kind = 'lease_acquired' AND namespace = $1",
            task,
        )
    )
    per_key: dict[str, list[Any]] = defaultdict(list)
    for e in effects:
        per_key[e["business_key"]].append(e)
    lost = [k for k in keys if not per_key.get(k)]
    v.lost = len(lost)
    v.fail("business keys whose job never took effect", lost)
    over = {
        k: len(per_key[k]) - (2 if k == forced_key else 1)
        for k in keys
        if len(per_key[k]) > (2 if k == forced_key else 1)
    }
    v.doubled = sum(over.values())
    v.fail("business keys whose job took effect too often (key, extra)", sorted(over.items()))
    v.fail("effects of unknown keys", sorted(set(per_key) - set(keys)))

    stale = [
        why
        for e in effects
        if (
            why := history.check(
                f"task:{task}:{e['business_key']}", e["token"], e["holder"], e["at"]
            )
        )
    ]
    v.stale_committed = len(stale)
    v.fail("job effects under a token that was not current at commit", stale)

    started = await conn.fetch(
        "SELECT key, token, from_state, (detail->>'forced')::boolean AS forced"
        " FROM dedup.events WHERE kind = 'task_started' AND namespace = $1",
        task,
    )
    succeeded = {
        (r["key"], r["token"])
        for r in await conn.fetch(
            "SELECT key, token FROM dedup.events WHERE kind = 'task_succeeded' AND namespace = $1",
            task,
        )
    }
    unrecorded = [
        (e["business_key"], e["token"])
        for e in effects
        if (e["business_key"], e["token"]) not in succeeded
    ]
    v.fail("effects without their task_succeeded event", unrecorded)
    forced_runs = [r for r in started if r["forced"]]
    forced_effects = [e for e in effects if e["forced"]]
    if [(r["key"], r["token"]) for r in forced_runs if r["from_state"] == "succeeded"] != [
        (e["business_key"], e["token"]) for e in forced_effects
    ]:
        runs = [(r["key"], r["token"], r["from_state"]) for r in forced_runs]
        made = [(e["business_key"], e["token"]) for e in forced_effects]
        v.violations.append(f"forced runs in events {runs} do not match the forced effects {made}")
    if forced_key is not None and not forced_effects:
        v.violations.append(f"the forced rerun of {forced_key} left no effect")
    states = await conn.fetch(
        "SELECT business_key, state, token FROM dedup.tasks WHERE task = $1", task
    )
    last = {k: max(e["token"] for e in es) for k, es in per_key.items()}
    wrong = [
        (s["business_key"], s["state"], s["token"])
        for s in states
        if s["state"] != "succeeded" or s["token"] != last.get(s["business_key"])
    ]
    v.fail("tasks not succeeded under their last effect's token", wrong)
    v.stale_refused = await conn.fetchval(
        "SELECT count(*) FROM dedup.events WHERE kind = 'lease_lost' AND namespace = $1", task
    )
    return v
