"""One arm of the benchmark, in a process of its own: ``python -m bench.arms CONFIG.json``.

A process per arm so that CPU time and peak RSS are the arm's own.  The parent
(``bench.run``) creates the topic and the arm's fresh database; this process
consumes the whole topic, checks the result and prints one JSON line.

What is timed, the same way in every arm:

- throughput: records in the topic / (last commit - first fetch); joining the
  group and creating tables come before the first fetch and are not counted;
- latency, per applied message: from the moment the consumer handed the record
  to code (``getmany``/``getone`` returned it) to the moment its transaction's
  COMMIT returned.  The record's own timestamp would only measure how long it
  waited in the pre-filled topic, which differs between arms run minutes apart;
- CPU: user + system seconds of this process over the same interval.

The hook on ``getmany``/``getone`` and the asyncpg query logger that sees the
COMMIT are installed in every database arm alike, so they cost every arm the
same.
"""

from __future__ import annotations

import array
import asyncio
import collections
import functools
import os
import re
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import asyncpg
import orjson
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from bench import stats, workload
from dedup.data import _sql as sql

ARMS = (
    "raw",
    "naive",
    "handwritten",
    "handwritten_concurrent",
    "dedup_per_message",
    "dedup_batch",
    "dedup_batch_traced",
    "hot_rows",
    "hot_rows_serial",
    "handwritten_confluent",
    "dedup_confluent",
)
"""The arms, in the order they run within a round."""

HOT_ARMS = ("hot_rows", "hot_rows_serial")
"""The README's per-message handler on few accounts (their own topic): dedup's defaults,
and the same with ``concurrency=1``."""
PER_MESSAGE_ARMS = ("naive", "dedup_per_message")
"""One transaction per message: they may read a smaller topic (``--per-message-messages``)."""
CONFLUENT_ARMS = ("handwritten_confluent", "dedup_confluent")
"""Blocking arms on confluent-kafka and psycopg, without asyncio: the loop a user of those writes
by hand, and dedup.sync.Consumer on the same workload."""
DEDUP_ARMS = (
    "dedup_per_message",
    "dedup_batch",
    "dedup_batch_traced",
    *HOT_ARMS,
    "dedup_confluent",
)
HOT_MESSAGES = 50_000
"""Payments in the hot-row topic by default (fewer when ``--messages`` is smaller)."""
SWEEP_PREFIX = "dedup_batch@"
"""``dedup_batch@N``: dedup_batch with ``batch_size=N``, for the batch-size plot."""

HANDWRITTEN_BATCH = 500
"""Messages per transaction in handwritten (and per getmany in raw): dedup's default."""
HANDWRITTEN_LANES = 4
"""Connections of handwritten_concurrent, each with its partitions: dedup's default concurrency."""

CLAIMS_DDL = """
CREATE TABLE claims (
    key          text        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE offsets (
    topic       text    NOT NULL,
    "partition" integer NOT NULL,
    next_offset bigint  NOT NULL,
    PRIMARY KEY (topic, "partition")
);
"""
CLAIM_ONE = "INSERT INTO claims (key) VALUES ($1) ON CONFLICT DO NOTHING RETURNING true"
CLAIM_MANY = (
    "INSERT INTO claims (key) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING RETURNING key"
)
STORE_OFFSETS = """
INSERT INTO offsets (topic, "partition", next_offset)
SELECT $1, * FROM unnest($2::int[], $3::bigint[])
ON CONFLICT (topic, "partition") DO UPDATE SET next_offset = excluded.next_offset
"""
LOAD_OFFSETS = 'SELECT "partition", next_offset FROM offsets WHERE topic = $1'


@dataclass
class Config:
    """What the parent hands an arm (as JSON)."""

    arm: str
    bootstrap_servers: str
    topic: str
    group_id: str
    dsn: str
    workload: dict[str, Any]
    end_offsets: dict[str, int]
    """Partition (as a string) -> its end offset once the topic was filled: where "done" is."""
    batch_size: int | None = None
    """dedup arms: ``batch_size`` passed to IdempotentConsumer (None: its default)."""
    dedup_options: dict[str, Any] = field(default_factory=dict)
    """dedup arms: more IdempotentConsumer options (``--dedup-option``), for finding levers."""
    measure_latency: bool = True
    """False in the soak, where keeping per-message timings would itself grow memory."""
    query_times: bool = False
    """Also sum the time spent in each SQL statement (for finding what limits an arm)."""
    ready_file: str | None = None
    """Created when the first record is fetched (the soak samples from then on); in a
    live run, once the consumer holds its partitions (the producer starts then)."""
    live: bool = False
    """A live stream: latency runs from the record's CreateTime to its COMMIT (wall clock)."""
    warmup_s: float = 0.0
    """Live: records produced in the first ``warmup_s`` seconds are not in the latencies."""
    timeout_s: float = 1800.0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB.

    On Linux this is VmHWM, which starts afresh at exec; ``ru_maxrss`` would
    carry over the parent's peak (it survives fork and exec).
    """
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / (1024 * 1024)


@dataclass
class Clock:
    """The measuring instruments, the same in every arm."""

    measure_latency: bool = True
    query_times: bool = False
    ready_file: str | None = None
    live: bool = False
    """Latency from the record's CreateTime (wall clock) instead of from its fetch."""
    warmup_s: float = 0.0
    first_fetch: float | None = None
    cpu_at_first: float = 0.0
    last_commit: float | None = None
    fetched: dict[tuple[int, int], float] = field(default_factory=dict)
    pending: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    latencies: array.array[float] = field(default_factory=lambda: array.array("d"))
    produced: array.array[float] = field(default_factory=lambda: array.array("d"))
    """Live: each latency's record CreateTime (s), to leave out the warm-up."""
    fetch_wall: dict[tuple[int, int], float] = field(default_factory=dict)
    """Live: when each record was handed to code (wall clock)."""
    to_fetch: array.array[float] = field(default_factory=lambda: array.array("d"))
    """Live: each latency's part from CreateTime to the fetch (Kafka's share)."""
    _watched: set[int] = field(default_factory=set)
    commits: int = 0
    """Transactions committed (on the watched connections)."""
    statements: dict[str, list[float]] = field(default_factory=dict)

    def install_kafka_hook(self) -> None:
        """Note when each record is handed to code, whoever calls getmany/getone."""
        getmany = AIOKafkaConsumer.getmany
        getone = AIOKafkaConsumer.getone
        clock = self

        @functools.wraps(getmany)
        async def timed_getmany(consumer: Any, *args: Any, **kwargs: Any) -> Any:
            batches = await getmany(consumer, *args, **kwargs)
            if batches:
                clock.saw([r for records in batches.values() for r in records])
            elif clock.live and consumer.assignment():
                clock.joined()
            return batches

        @functools.wraps(getone)
        async def timed_getone(consumer: Any, *args: Any) -> Any:
            record = await getone(consumer, *args)
            clock.saw([record])
            return record

        AIOKafkaConsumer.getmany = timed_getmany
        AIOKafkaConsumer.getone = timed_getone

    def joined(self) -> None:
        """Live: the consumer holds its partitions, so the producer may start."""
        if self.ready_file:
            Path(self.ready_file).touch()

    def saw(self, records: Sequence[Any]) -> None:
        """Records were handed to code now."""
        now = time.perf_counter()
        if self.first_fetch is None:
            self.first_fetch = now
            self.cpu_at_first = cpu_seconds()
            if self.ready_file and not self.live:
                Path(self.ready_file).touch()
        if self.measure_latency:
            if self.live:
                wall = time.time()
                for r in records:
                    self.fetched[r.partition, r.offset] = r.timestamp / 1000
                    self.fetch_wall[r.partition, r.offset] = wall
                return
            for r in records:
                self.fetched[r.partition, r.offset] = now

    def watch(self, conn: Any) -> int:
        """Log this connection's COMMITs (once per connection); return its key."""
        raw = getattr(conn, "_con", None) or conn  # a pool's proxy wraps the connection
        key = id(raw)
        if key not in self._watched:
            self._watched.add(key)
            self.pending[key] = []
            raw.add_query_logger(functools.partial(self._logged, key))
        return key

    def applied(self, conn: Any, where: Sequence[tuple[int, int]]) -> None:
        """These (partition, offset) were applied in the open transaction on ``conn``."""
        key = self.watch(conn)
        if self.measure_latency:
            self.pending[key].extend(where)

    def pend(self, key: int, where: Sequence[tuple[int, int]]) -> None:
        """These (partition, offset) were applied in the open transaction of connection ``key``
        (an arm that tells :meth:`committed` itself when it commits: the psycopg arms)."""
        if self.measure_latency:
            self.pending.setdefault(key, []).extend(where)

    def _logged(self, key: int, record: Any) -> None:
        if self.query_times and self.first_fetch is not None:
            name = " ".join(record.query.split())[:60]
            total = self.statements.setdefault(name, [0, 0.0])
            total[0] += 1
            total[1] += record.elapsed
        verb = record.query.lstrip()[:8].upper()
        # dedup sends its session reset and COMMIT as one message ("...; COMMIT").
        last = record.query.rstrip().rstrip(";").rsplit(";", 1)[-1].strip()[:8].upper()
        if verb.startswith("ROLLBACK"):
            # A batch that rolled back (a deadlock) is applied again, maybe on another lane.
            self.pending.get(key, []).clear()
            return
        if record.exception is not None or not last.startswith("COMMIT"):
            return
        self.committed(key)

    def committed(self, key: int) -> None:
        """The transaction on connection ``key`` committed now."""
        now = time.perf_counter()
        self.last_commit = now
        self.commits += 1
        done = self.pending.get(key)
        if done:
            if self.live:
                wall = time.time()
                for where in done:
                    produced = self.fetched.pop(where, None)
                    if produced is not None:
                        self.latencies.append(wall - produced)
                        self.produced.append(produced)
                        self.to_fetch.append(self.fetch_wall.pop(where, wall) - produced)
            else:
                for where in done:
                    started = self.fetched.pop(where, None)
                    if started is not None:
                        self.latencies.append(now - started)
            done.clear()

    def result(self, messages: int, end: float | None = None) -> dict[str, Any]:
        """The timed figures of this arm."""
        finish = end if end is not None else self.last_commit
        if self.first_fetch is None or finish is None:
            raise RuntimeError("nothing was fetched or committed")
        elapsed = finish - self.first_fetch
        cpu = cpu_seconds() - self.cpu_at_first
        lat = list(self.latencies)
        fetch_part: list[float] = []
        if self.live and self.produced:
            since = min(self.produced) + self.warmup_s
            kept = [i for i, t in enumerate(self.produced) if t >= since]
            lat = [self.latencies[i] for i in kept]
            fetch_part = [self.to_fetch[i] for i in kept]
        return {
            "messages": messages,
            "elapsed_s": round(elapsed, 4),
            "msgs_per_s": round(messages / elapsed, 1),
            "p50_ms": round(1000 * stats.percentile(lat, 50), 3) if lat else None,
            "p99_ms": round(1000 * stats.percentile(lat, 99), 3) if lat else None,
            "latency_samples": len(lat),
            "transactions": self.commits,
            **(live_percentiles(lat, fetch_part) if self.live and lat else {}),
            "cpu_s": round(cpu, 3),
            "cpu_s_per_10k": round(cpu * 10_000 / messages, 4),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            **({"statements": self.top_statements()} if self.query_times else {}),
        }

    def top_statements(self) -> list[dict[str, Any]]:
        """Statements by total time, most first: where an arm waits on Postgres."""
        ranked = sorted(self.statements.items(), key=lambda item: -item[1][1])
        return [
            {"sql": sql, "calls": int(calls), "total_s": round(secs, 3)}
            for sql, (calls, secs) in ranked[:12]
        ]


CDF_POINTS = (*range(0, 100), 99.5, 99.9, 99.99, 100)
"""Percentiles kept of a live run's latencies, for the distribution plot."""


def live_percentiles(lat: Sequence[float], to_fetch: Sequence[float]) -> dict[str, Any]:
    """p99.9 and the latency distribution (ms at each of :data:`CDF_POINTS`) of a live run;
    the p50 and p99 of the part before the record reached code (produce + fetch)."""
    ordered = sorted(lat)
    return {
        "to_fetch_p50_ms": round(1000 * stats.percentile(to_fetch, 50), 3),
        "to_fetch_p99_ms": round(1000 * stats.percentile(to_fetch, 99), 3),
        "p999_ms": round(1000 * stats.percentile(ordered, 99.9), 3),
        "max_ms": round(1000 * ordered[-1], 3),
        "cdf_ms": [[q, round(1000 * stats.percentile(ordered, q), 3)] for q in CDF_POINTS],
    }


def _consumer(cfg: Config, **options: Any) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        group_id=cfg.group_id,
        auto_offset_reset="earliest",
        **options,
    )


async def _connect(cfg: Config) -> asyncpg.Connection:
    return await asyncpg.connect(cfg.dsn)


class Progress:
    """Where each partition stands; done once every one reached the topic's end."""

    def __init__(self, end_offsets: dict[str, int]) -> None:
        self.end = {int(p): end for p, end in end_offsets.items() if end > 0}
        self.left = set(self.end)
        self.assignments = 0

    def at(self, partition: int, next_offset: int) -> None:
        """``partition`` has been applied up to ``next_offset`` (exclusive)."""
        if partition in self.left and next_offset >= self.end[partition]:
            self.left.discard(partition)

    @property
    def done(self) -> bool:
        """Every partition is applied to its end."""
        return not self.left


def _fields(value: bytes) -> tuple[str, str, int]:
    doc = orjson.loads(value)
    return doc["id"], doc["account"], doc["amount"]


async def run_raw(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """The Kafka ceiling: getmany and decode, no database."""
    consumer = _consumer(cfg, enable_auto_commit=False)
    consumer.subscribe([cfg.topic])
    await consumer.start()
    progress = Progress(cfg.end_offsets)
    try:
        while not progress.done:
            batches = await consumer.getmany(timeout_ms=1000, max_records=HANDWRITTEN_BATCH)
            for tp, records in batches.items():
                for r in records:
                    _fields(r.value)
                progress.at(tp.partition, records[-1].offset + 1)
        end = time.perf_counter()
    finally:
        await consumer.stop()
    return clock.result(total, end)


async def run_naive(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """One transaction per message: claim the key, write the effect, update the sum."""
    conn = await _connect(cfg)
    clock.watch(conn)
    consumer = _consumer(cfg)  # offsets: Kafka's auto-commit, as most hand-written loops do
    consumer.subscribe([cfg.topic])
    await consumer.start()
    progress = Progress(cfg.end_offsets)
    try:
        async for record in consumer:
            key, account, amount = _fields(record.value)
            async with conn.transaction():
                if await conn.fetchval(CLAIM_ONE, key):
                    await conn.execute(workload.EFFECT_ONE, key, account, amount)
                    await conn.execute(workload.ACCOUNT_ONE, account, amount)
                    clock.applied(conn, [(record.partition, record.offset)])
            progress.at(record.partition, record.offset + 1)
            if progress.done:
                break
    finally:
        await consumer.stop()
        await conn.close()
    return clock.result(total)


@dataclass
class _SeekToStored(ConsumerRebalanceListener):  # type: ignore[misc]
    """Offsets live in Postgres: start each assigned partition where the table says."""

    consumer: AIOKafkaConsumer
    conn: asyncpg.Connection
    topic: str
    progress: Progress
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """The loop's transactions and this callback share one connection: they take turns."""

    async def on_partitions_revoked(self, revoked: Any) -> None:
        return None

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.progress.assignments += 1
        async with self.lock:
            stored = dict(await self.conn.fetch(LOAD_OFFSETS, self.topic))
        for tp in assigned:
            if tp.partition in stored:  # else auto_offset_reset applies
                self.consumer.seek(tp, stored[tp.partition])


async def _apply_batch(
    conn: asyncpg.Connection, cfg: Config, clock: Clock, records: Sequence[Any]
) -> dict[int, int]:
    """The hand-written transaction: claim the keys, write the effects, store the offsets.

    Returns partition -> next offset of what it applied.
    """
    decoded = [(r, *_fields(r.value)) for r in records]
    next_offsets: dict[int, int] = {}
    for r in records:
        next_offsets[r.partition] = max(next_offsets.get(r.partition, 0), r.offset + 1)
    async with conn.transaction():
        fresh = {row[0] for row in await conn.fetch(CLAIM_MANY, [d[1] for d in decoded])}
        # The first copy of each fresh key (a batch may hold a redelivery too).
        first = []
        for d in decoded:
            if d[1] in fresh:
                fresh.discard(d[1])
                first.append(d)
        if first:
            await conn.execute(
                workload.EFFECT_MANY,
                [d[1] for d in first],
                [d[2] for d in first],
                [d[3] for d in first],
            )
            await conn.execute(workload.ACCOUNT_MANY, [d[2] for d in first], [d[3] for d in first])
        await conn.execute(
            STORE_OFFSETS, cfg.topic, list(next_offsets), list(next_offsets.values())
        )
        clock.applied(conn, [(d[0].partition, d[0].offset) for d in first])
    return next_offsets


async def run_handwritten(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """The best hand-written batched loop: one transaction per getmany, set-based statements."""
    conn = await _connect(cfg)
    clock.watch(conn)
    consumer = _consumer(cfg, enable_auto_commit=False)
    progress = Progress(cfg.end_offsets)
    listener = _SeekToStored(consumer, conn, cfg.topic, progress)
    consumer.subscribe([cfg.topic], listener=listener)
    await consumer.start()
    try:
        while not progress.done:
            batches = await consumer.getmany(timeout_ms=1000, max_records=HANDWRITTEN_BATCH)
            if not batches:
                continue
            records = [r for rs in batches.values() for r in rs]
            async with listener.lock:
                next_offsets = await _apply_batch(conn, cfg, clock, records)
            for partition, next_offset in next_offsets.items():
                progress.at(partition, next_offset)
    finally:
        await consumer.stop()
        await conn.close()
    result = clock.result(total)
    result["assignments"] = progress.assignments
    return result


async def run_handwritten_concurrent(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """handwritten with partitions side by side: HANDWRITTEN_LANES connections, each its own
    partitions (``partition % lanes``), one transaction per batch of a lane's queue.

    The fetch loop hands records to the lanes' queues and pauses a lane's
    partitions while its queue holds two batches; a lane takes what its queue
    holds (up to HANDWRITTEN_BATCH) as soon as its last transaction committed.
    """
    conns = [await _connect(cfg) for _ in range(HANDWRITTEN_LANES)]
    for conn in conns:
        clock.watch(conn)
    seeker = await _connect(cfg)  # the rebalance listener's own
    consumer = _consumer(cfg, enable_auto_commit=False)
    progress = Progress(cfg.end_offsets)
    consumer.subscribe([cfg.topic], listener=_SeekToStored(consumer, seeker, cfg.topic, progress))
    queues: list[collections.deque[Any]] = [collections.deque() for _ in conns]
    more = [asyncio.Event() for _ in conns]
    paused: set[int] = set()

    async def lane(i: int) -> None:
        while True:
            await more[i].wait()
            queue = queues[i]
            records = [queue.popleft() for _ in range(min(HANDWRITTEN_BATCH, len(queue)))]
            if not queue:
                more[i].clear()
            for partition, next_offset in (
                await _apply_batch(conns[i], cfg, clock, records)
            ).items():
                progress.at(partition, next_offset)

    await consumer.start()
    lanes = [asyncio.create_task(lane(i)) for i in range(len(conns))]
    try:
        while not progress.done:
            for task in lanes:
                if task.done():
                    task.result()  # raises what stopped it
            batches = await consumer.getmany(
                timeout_ms=100, max_records=HANDWRITTEN_BATCH * len(conns)
            )
            for tp, records in batches.items():
                i = tp.partition % len(conns)
                queues[i].extend(records)
                more[i].set()
            for i, queue in enumerate(queues):
                mine = [tp for tp in consumer.assignment() if tp.partition % len(conns) == i]
                if i not in paused and len(queue) >= 2 * HANDWRITTEN_BATCH:
                    consumer.pause(*mine)
                    paused.add(i)
                elif i in paused and len(queue) < HANDWRITTEN_BATCH:
                    consumer.resume(*mine)
                    paused.discard(i)
    finally:
        for task in lanes:
            task.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        await consumer.stop()
        for conn in [*conns, seeker]:
            await conn.close()
    result = clock.result(total)
    result["assignments"] = progress.assignments
    return result


class CountingSpanExporter:
    """A span exporter that only counts: the SDK does all its work, nothing is slow after it."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def install_sdk() -> tuple[CountingSpanExporter, Callable[[], None]]:
    """The OpenTelemetry SDK as an application would install it.

    Tracing: a TracerProvider with the SDK's default sampler (parent-based,
    always on) and a BatchSpanProcessor feeding a counting exporter.  Metrics: a
    MeterProvider whose periodic reader writes to /dev/null.  Returns the
    exporter and a function that flushes and shuts both down.
    """
    import os

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = CountingSpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))  # type: ignore[arg-type]
    trace.set_tracer_provider(tracer_provider)
    devnull = open(os.devnull, "w")  # closed by shutdown()
    meter_provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(ConsoleMetricExporter(out=devnull))]
    )
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        tracer_provider.force_flush()
        tracer_provider.shutdown()
        meter_provider.shutdown()
        devnull.close()

    return exporter, shutdown


async def run_dedup(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """dedup.IdempotentConsumer with the same business writes (batch or per message)."""
    exporter = shutdown = None
    if cfg.arm == "dedup_batch_traced":
        exporter, shutdown = install_sdk()
    import dedup

    await dedup.migrate(cfg.dsn)
    handler, options = _dedup_handler(cfg, clock)
    consumer = dedup.IdempotentConsumer(
        handler,
        topics=[cfg.topic],
        group_id=cfg.group_id,
        bootstrap_servers=cfg.bootstrap_servers,
        dsn=cfg.dsn,
        key=dedup.keys.json_field("id"),
        auto_offset_reset="earliest",
        install_signal_handlers=False,
        **options,
    )
    task = asyncio.create_task(consumer.run())
    counted = ("processed", "duplicates", "dead_lettered", "conflicts")
    watcher = await _connect(cfg)
    try:
        while True:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("the consumer stopped before consuming the whole topic")
            # The counters are a cheap first hint; the offsets dedup stored in
            # Postgres are the proof that every partition is applied to its end.
            if sum(consumer.stats.get(k, 0) for k in counted) >= total:
                await asyncio.sleep(0)  # let the last COMMIT's query logger run
                end = clock.last_commit
                if await _dedup_done(watcher, cfg):
                    break
            await asyncio.sleep(0.01)
        result = clock.result(total, end)
    finally:
        await watcher.close()
        await consumer.stop()
        await task
    result["stats"] = dict(consumer.stats)
    if shutdown is not None and exporter is not None:
        shutdown()
        result["spans_exported"] = exporter.spans
    return result


def _dedup_handler(cfg: Config, clock: Clock) -> tuple[Any, dict[str, Any]]:
    """The arm's handler and the IdempotentConsumer options that go with it."""
    import dedup

    async def handle_batch(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        decoded = [m.json() for m in msgs]
        await tx.conn.execute(
            workload.EFFECT_MANY,
            [d["id"] for d in decoded],
            [d["account"] for d in decoded],
            [d["amount"] for d in decoded],
        )
        await tx.conn.execute(
            workload.ACCOUNT_MANY, [d["account"] for d in decoded], [d["amount"] for d in decoded]
        )
        clock.applied(tx.conn, [(m.partition, m.offset) for m in msgs])

    async def handle_one(msg: dedup.Message, tx: dedup.Tx) -> None:
        doc = msg.json()
        await tx.conn.execute(workload.EFFECT_ONE, doc["id"], doc["account"], doc["amount"])
        await tx.conn.execute(workload.ACCOUNT_ONE, doc["account"], doc["amount"])
        clock.applied(tx.conn, [(msg.partition, msg.offset)])

    async def apply_payment(msg: dedup.Message, tx: dedup.Tx) -> None:
        # The README's handler, with the payment row that shows a payment applied twice.
        p = msg.json()
        await tx.conn.execute(workload.HOT_BALANCE, p["account"], p["amount"])
        await tx.conn.execute(workload.HOT_PAYMENT, p["id"], p["account"], p["amount"])
        clock.applied(tx.conn, [(msg.partition, msg.offset)])

    # BENCH_DEDUP_OPTIONS (a JSON object) tries other IdempotentConsumer options on every
    # dedup arm but the serial hot-row one, e.g. {"concurrency": 2} to choose its default.
    tried = orjson.loads(os.environ.get("BENCH_DEDUP_OPTIONS", "{}"))
    if cfg.arm in HOT_ARMS:
        # Everything at dedup's defaults but, in the serial arm, one lane.
        return apply_payment, {"concurrency": 1} if cfg.arm == "hot_rows_serial" else tried
    if cfg.arm == "dedup_per_message":
        return handle_one, {"batch_size": 1, **tried}
    options: dict[str, Any] = {"batch": True, **tried, **cfg.dedup_options}
    if cfg.batch_size is not None:
        options["batch_size"] = cfg.batch_size
    return handle_batch, options


async def _dedup_done(conn: asyncpg.Connection, cfg: Config) -> bool:
    # The library's own query: the bench reads positions as the consumer does.
    position = sql.Queries().partition_position
    for partition, end in cfg.end_offsets.items():
        row = await position.fetchrow(
            conn, group_id=cfg.group_id, topic=cfg.topic, partition=int(partition)
        )
        if row is None or (row["next_offset"] or 0) < end:
            return False
    return True


# ------------------------------------------------ confluent-kafka + psycopg --


def _psycopg(statement: str) -> str:
    """A statement of the asyncpg arms with psycopg's placeholders (each ``$n`` is used once,
    in order)."""
    return re.sub(r"\$\d+", "%s", statement)


CLAIM_MANY_PSYCOPG = _psycopg(CLAIM_MANY)
EFFECT_MANY_PSYCOPG = _psycopg(workload.EFFECT_MANY)
ACCOUNT_MANY_PSYCOPG = _psycopg(workload.ACCOUNT_MANY)


class _Seen(NamedTuple):
    """A confluent-kafka record as the clock reads it."""

    partition: int
    offset: int
    timestamp: int


def _timed_confluent(clock: Clock) -> Any:
    """confluent-kafka's consumer, noting when ``consume()`` hands records to code: the clock of
    both confluent arms (getmany's hook, for them).  It replaces ``confluent_kafka.Consumer``,
    the name dedup.sync.Consumer makes its consumer from."""
    import confluent_kafka

    class TimedConsumer(confluent_kafka.Consumer):
        def consume(self, *args: Any, **kwargs: Any) -> list[Any]:
            msgs: list[Any] = super().consume(*args, **kwargs)
            seen = [
                _Seen(m.partition(), m.offset(), m.timestamp()[1])
                for m in msgs
                if m.error() is None
            ]
            if seen:
                clock.saw(seen)
            return msgs

    confluent_kafka.Consumer = TimedConsumer  # type: ignore[misc]
    return TimedConsumer


def _confluent_config(cfg: Config) -> dict[str, Any]:
    """The consumer settings both confluent arms start from."""
    return {"bootstrap.servers": cfg.bootstrap_servers, "auto.offset.reset": "earliest"}


def run_handwritten_confluent(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """The loop a confluent-kafka + psycopg user writes: ``consume()`` a batch (500), one
    transaction claiming the keys (``ON CONFLICT DO NOTHING``) and writing the fresh ones'
    effects set-based, COMMIT, then commit the offsets to Kafka (asynchronously)."""
    import confluent_kafka
    import psycopg

    consumer = _timed_confluent(clock)(
        {**_confluent_config(cfg), "group.id": cfg.group_id, "enable.auto.commit": False}
    )
    consumer.subscribe([cfg.topic])
    progress = Progress(cfg.end_offsets)
    deadline = time.monotonic() + cfg.timeout_s
    try:
        with psycopg.connect(cfg.dsn) as conn:
            while not progress.done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done after {cfg.timeout_s:g}s")
                records = []
                for msg in consumer.consume(num_messages=HANDWRITTEN_BATCH, timeout=1.0):
                    if msg.error() is None:
                        records.append(msg)
                    elif msg.error().fatal():
                        raise confluent_kafka.KafkaException(msg.error())
                if not records:
                    continue
                next_offsets = _apply_batch_psycopg(conn, clock, records)
                consumer.commit(asynchronous=True)
                for partition, next_offset in next_offsets.items():
                    progress.at(partition, next_offset)
    finally:
        consumer.close()
    return clock.result(total)


def _apply_batch_psycopg(conn: Any, clock: Clock, records: Sequence[Any]) -> dict[int, int]:
    """:func:`_apply_batch` on psycopg, offsets left to Kafka: partition -> next offset."""
    decoded = [(r, *_fields(r.value())) for r in records]
    next_offsets: dict[int, int] = {}
    for r in records:
        next_offsets[r.partition()] = max(next_offsets.get(r.partition(), 0), r.offset() + 1)
    with conn.transaction():
        claimed = conn.execute(CLAIM_MANY_PSYCOPG, ([d[1] for d in decoded],))
        fresh = {row[0] for row in claimed}
        first = []
        for d in decoded:
            if d[1] in fresh:
                fresh.discard(d[1])
                first.append(d)
        if first:
            conn.execute(
                EFFECT_MANY_PSYCOPG,
                ([d[1] for d in first], [d[2] for d in first], [d[3] for d in first]),
            )
            conn.execute(ACCOUNT_MANY_PSYCOPG, ([d[2] for d in first], [d[3] for d in first]))
        clock.pend(0, [(d[0].partition(), d[0].offset()) for d in first])
    clock.committed(0)
    return next_offsets


def run_dedup_confluent(cfg: Config, clock: Clock, total: int) -> dict[str, Any]:
    """dedup.sync.Consumer with the handwritten arm's two set-based writes, on psycopg."""
    import dedup
    from dedup import _faults as faults

    _timed_confluent(clock)
    progress = Progress(cfg.end_offsets)
    end: list[float] = []

    def handle(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
        decoded = [m.json() for m in msgs]
        tx.conn.execute(
            EFFECT_MANY_PSYCOPG,
            (
                [d["id"] for d in decoded],
                [d["account"] for d in decoded],
                [d["amount"] for d in decoded],
            ),
        )
        tx.conn.execute(
            ACCOUNT_MANY_PSYCOPG, ([d["account"] for d in decoded], [d["amount"] for d in decoded])
        )
        clock.pend(0, [(m.partition, m.offset) for m in msgs])

    tried = orjson.loads(os.environ.get("BENCH_DEDUP_OPTIONS", "{}"))
    options: dict[str, Any] = {"batch": True, **tried, **cfg.dedup_options}
    if cfg.batch_size is not None:
        options["batch_size"] = cfg.batch_size
    consumer = dedup.sync.Consumer(
        handle,
        topics=[cfg.topic],
        group_id=cfg.group_id,
        config=_confluent_config(cfg),
        dsn=cfg.dsn,
        key=dedup.keys.json_field("id"),
        install_signal_handlers=False,
        **options,
    )

    async def after_commit(*, msgs: Any, dead: Any, result: Any, **_: Any) -> None:
        # Once per partition of the transaction, after its COMMIT (dedup._faults).
        if clock.pending.get(0):
            clock.committed(0)
        else:
            clock.last_commit = time.perf_counter()
        last = msgs[-1] if msgs else dead[-1].msg
        progress.at(last.partition, result.next_offset)
        if progress.done and not end:
            end.append(time.perf_counter())
            consumer.stop()

    timer = threading.Timer(cfg.timeout_s, consumer.stop)
    timer.start()
    try:
        with faults.install(faults.Point.AFTER_COMMIT, after_commit):
            consumer.run()
    finally:
        timer.cancel()
    if not end:
        raise RuntimeError("the consumer stopped before consuming the whole topic")
    result = clock.result(total, end[0])
    result["stats"] = dict(consumer.stats)
    return result


BLOCKING_RUNNERS: dict[str, Callable[[Config, Clock, int], dict[str, Any]]] = {
    "handwritten_confluent": run_handwritten_confluent,
    "dedup_confluent": run_dedup_confluent,
}
"""The arms without asyncio: run in the process's main thread, as a worker runs them."""


RUNNERS = {
    "raw": run_raw,
    "naive": run_naive,
    "handwritten": run_handwritten,
    "handwritten_concurrent": run_handwritten_concurrent,
}


async def prepare(cfg: Config) -> None:
    """Business tables (and, for the hand-written arms, their claim and offset tables)."""
    if cfg.arm == "raw":
        return
    conn = await _connect(cfg)
    try:
        if cfg.arm in HOT_ARMS:
            await conn.execute(workload.HOT_DDL)
            names = [workload.account_name(i) for i in range(workload.HOT_ACCOUNTS)]
            await conn.execute(workload.HOT_OPEN_ACCOUNTS, names)
            return
        await conn.execute(workload.BUSINESS_DDL)
        if cfg.arm in ("naive", "handwritten", "handwritten_concurrent", "handwritten_confluent"):
            await conn.execute(CLAIMS_DDL)
        if cfg.arm == "dedup_confluent":
            import dedup

            await dedup.migrate(cfg.dsn)
    finally:
        await conn.close()


async def verify(cfg: Config, expected: workload.Workload) -> tuple[bool, str]:
    """The arm's check: one effect per distinct key and the right sums (raw has none)."""
    if cfg.arm == "raw":
        return True, "no database"
    conn = await _connect(cfg)
    try:
        if cfg.arm in HOT_ARMS:
            return await workload.check_hot(conn, expected)
        return await workload.check(conn, expected)
    finally:
        await conn.close()


async def main(cfg: Config) -> dict[str, Any]:
    """Prepare, consume the topic, check; the result as a dict."""
    expected = workload.Workload.from_dict(cfg.workload)
    await prepare(cfg)
    clock = Clock(
        measure_latency=cfg.measure_latency,
        query_times=cfg.query_times,
        ready_file=cfg.ready_file,
        live=cfg.live,
        warmup_s=cfg.warmup_s,
    )
    clock.install_kafka_hook()
    blocking = BLOCKING_RUNNERS.get(cfg.arm)
    if blocking is not None:
        # The loop's thread, blocked: nothing else runs on it meanwhile.
        result = blocking(cfg, clock, expected.messages)
    else:
        runner = RUNNERS.get(cfg.arm, run_dedup)
        result = await asyncio.wait_for(runner(cfg, clock, expected.messages), cfg.timeout_s)
    ok, detail = await verify(cfg, expected)
    result.update(arm=cfg.arm, ok=ok, check=detail, batch_size=cfg.batch_size)
    return result


if __name__ == "__main__":
    config = Config(**orjson.loads(Path(sys.argv[1]).read_bytes()))
    print(orjson.dumps(asyncio.run(main(config))).decode(), flush=True)
