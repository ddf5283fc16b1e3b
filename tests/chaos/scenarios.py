"""The scenarios, their sizes per matrix, and the seeded fault schedule and messages of a run.

A run is (scenario, seed).  The seed fixes, through :class:`random.Random`
streams named after the scenario and the seed:

- the schedule: which faults, in which order, when (seconds after the group
  owns every partition), against which target (a fraction of the candidates
  sorted by name, so the same seed picks the same member whenever the
  ownership is the same), in which phase (before or after the commit, inside
  or between batches), and for how long (downtimes, respawn delays, pauses);
- the messages: the i-th record of a run is always the same (key, payload,
  headers, partition), and so are the poison records and the duplicates.

What a seed cannot fix is the operating system's interleaving: when exactly
a batch boundary falls, how long a rebalance takes.  Replaying a seed replays
the same faults against the same traffic, which is what makes a failure
reproducible in practice (Jepsen and Kafka's system tests work the same way).

Environment:

``CHAOS_MATRIX``  ``short`` (default: one seed per scenario, small counts; part
                  of ``make test``), ``full`` (``make chaos``: several seeds,
                  larger counts), ``tiny`` (the docs test's smoke run)
``CHAOS_SEED``    run only this seed (with the chosen matrix's sizes)

A scenario without a size for a matrix is not part of it (``failover_sync``
is left out of ``short``: ``failover`` is the one ``make test`` runs).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

MATRICES = ("tiny", "short", "full")
ACCOUNTS = 10
"""The hot rows of the ``hot_rows`` scenario: account balances every partition updates."""
SEEDS = {"tiny": [1], "short": [1], "full": [11, 12, 13]}


def matrix() -> str:
    """The matrix this session runs (``CHAOS_MATRIX``)."""
    name = os.environ.get("CHAOS_MATRIX", "short")
    if name not in MATRICES:
        raise ValueError(f"CHAOS_MATRIX={name!r}: expected one of {', '.join(MATRICES)}")
    return name


def seeds() -> list[int]:
    """The seeds this session runs (``CHAOS_SEED`` or the matrix's list)."""
    one = os.environ.get("CHAOS_SEED")
    return [int(one)] if one else SEEDS[matrix()]


@dataclass(frozen=True)
class Size:
    """How big one run is."""

    messages: int
    """Records produced at least (production goes on while faults remain)."""
    faults: int
    """Faults injected (a storm's join and leave count as one each)."""
    partitions: int = 3
    consumers: int = 2
    rate: float = 120.0
    """Records per second the producer sends."""
    batch_size: int = 25


@dataclass(frozen=True)
class Fault:
    """One scheduled fault."""

    at: float
    """Seconds after the group first owns every partition; never earlier."""
    kind: str
    """What is done (see :mod:`tests.chaos.driver`)."""
    pick: float = 0.0
    """Which target: this fraction of the candidates, sorted by name."""
    wait: float = 0.0
    """Downtime, respawn delay, extra pause beyond the takeover, or a member's lifetime."""
    arg: float = 0.0
    """A kind's own number: the slow handler's seconds."""
    member: int = -1
    """For storm members: which one joins or leaves."""

    def describe(self) -> str:
        extra = f" member={self.member}" if self.member >= 0 else f" pick={self.pick:.2f}"
        if self.wait:
            extra += f" wait={self.wait:.1f}s"
        if self.arg:
            extra += f" arg={self.arg:.1f}"
        return f"t+{self.at:.1f}s {self.kind}{extra}"


@dataclass(frozen=True)
class ConsumerOptions:
    """The consumer processes' settings in a scenario."""

    session_timeout_ms: int = 3000
    max_poll_interval_ms: int = 300_000
    idle_timeout_ms: int = 4000
    hold: float = 0.0
    """Seconds each batch's transaction stays open after its writes."""
    handler: str = "plain"
    """What the handler does besides its effect row (see :mod:`tests.chaos.consumer_child`)."""


@dataclass(frozen=True)
class Traffic:
    """What the producer mixes in besides plain records (shares of all records)."""

    poison: float = 0.0
    """Bad JSON, no key field, a handler bug, or a conflicting payload."""
    producer_duplicates: float = 0.0
    """The same record sent twice in a row (a producer retry)."""
    later_duplicates: float = 0.0
    """An earlier record sent again later, half of them to another partition."""
    accounts: float = 0.0
    """Plain records that name one of the ACCOUNTS accounts their amount goes to.

    Not all of them in ``hot_rows``: when every record does, a backlog's full
    batches deadlock nearly every time (each deadlock waits out Postgres'
    ``deadlock_timeout``) and the group never catches up; that handler needs
    ``tx.lock`` (docs/concepts/guarantees.md)."""


Schedule = Callable[[random.Random, Size], list[Fault]]


@dataclass(frozen=True)
class Scenario:
    """One fault class of the failure model."""

    name: str
    title: str
    sizes: dict[str, Size]
    schedule: Schedule
    options: ConsumerOptions = field(default_factory=ConsumerOptions)
    traffic: Traffic = field(default_factory=Traffic)
    tasks: bool = False
    replica: str = ""
    """``async`` / ``sync``: the run has a streaming standby of that kind
    (:mod:`tests.chaos.pg_failover`)."""


def _spread(rng: random.Random, n: int, start: float, gap: float) -> list[float]:
    """``n`` times from ``start``, about ``gap`` apart, jittered."""
    return [start + i * gap + rng.uniform(0, gap * 0.4) for i in range(n)]


def _balanced(rng: random.Random, kinds: list[str], n: int) -> list[str]:
    """``n`` kinds, each of ``kinds`` as often as the others (±1), in a seeded order."""
    out = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(out)
    return out


def kill_schedule(rng: random.Random, size: Size) -> list[Fault]:
    kinds = _balanced(rng, ["kill_before_commit", "kill_after_commit"], size.faults)
    return [
        Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.1, 1.0))
        for at, kind in zip(_spread(rng, size.faults, 1.0, 2.0), kinds, strict=True)
    ]


def pause_schedule(rng: random.Random, size: Size) -> list[Fault]:
    kinds = _balanced(rng, ["pause_before_begin", "pause_in_batch", "pause_between"], size.faults)
    return [
        Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.0, 1.0))
        for at, kind in zip(_spread(rng, size.faults, 1.0, 1.5), kinds, strict=True)
    ]


def kafka_schedule(rng: random.Random, size: Size) -> list[Fault]:
    kinds = _balanced(rng, ["kafka_restart", "kafka_kill"], size.faults)
    return [
        Fault(at, kind, wait=rng.uniform(0.2, 2.0))
        for at, kind in zip(_spread(rng, size.faults, 1.5, 2.0), kinds, strict=True)
    ]


def postgres_schedule(rng: random.Random, size: Size) -> list[Fault]:
    crashes = max(1, size.faults // 3)
    kinds = ["pg_crash"] * crashes + ["pg_terminate"] * (size.faults - crashes)
    rng.shuffle(kinds)
    return [
        Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.3, 2.0))
        for at, kind in zip(_spread(rng, size.faults, 1.0, 1.5), kinds, strict=True)
    ]


def storm_schedule(rng: random.Random, size: Size) -> list[Fault]:
    """Members join every 1.5-3 s and leave (SIGTERM or SIGKILL) 1.5-4 s later; one slow batch."""
    faults: list[Fault] = []
    members = max(1, (size.faults - 1) // 2)
    at = 0.5
    for m in range(members):
        faults.append(Fault(at, "join", member=m))
        life = rng.uniform(1.5, 4.0)
        leave = rng.choice(["leave_term", "leave_kill"])
        faults.append(Fault(at + life, leave, member=m))
        at += rng.uniform(1.5, 3.0)
    slow_at = rng.uniform(1.0, max(at, 2.0))
    faults.append(Fault(slow_at, "slow", pick=rng.random(), arg=rng.uniform(3.5, 5.0)))
    return sorted(faults, key=lambda f: f.at)


def poison_schedule(rng: random.Random, size: Size) -> list[Fault]:
    return kill_schedule(rng, size)


def replay_schedule(rng: random.Random, size: Size) -> list[Fault]:
    """Kills while the topic is read the first time, then the replay, struck by one more kill."""
    kills = kill_schedule(rng, Size(size.messages, max(size.faults - 1, 0)))
    replay = Fault(
        (kills[-1].at if kills else 0.0) + 1.0,
        "replay",
        pick=rng.random(),
        wait=rng.uniform(0.1, 1.0),
        arg=float(rng.random() < 0.5),  # 1: the replay's kill strikes after a commit
    )
    return [*kills, replay]


def hot_rows_schedule(rng: random.Random, size: Size) -> list[Fault]:
    """A pause inside a batch (its hot rows stay locked until the server cuts its session
    off), and kills before and after the commit."""
    kinds = _balanced(
        rng, ["pause_in_batch", "kill_before_commit", "kill_after_commit"], size.faults
    )
    return [
        Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.1, 1.0))
        for at, kind in zip(_spread(rng, size.faults, 1.0, 2.0), kinds, strict=True)
    ]


def hang_schedule(rng: random.Random, size: Size) -> list[Fault]:
    """Records whose handler hangs, each to a seeded partition; every third fault a kill."""
    kinds = ["kill_before_commit" if i % 3 == 2 else "hang" for i in range(size.faults)]
    return [
        Fault(at, kind, pick=rng.random(), wait=rng.uniform(0.1, 1.0))
        for at, kind in zip(_spread(rng, size.faults, 1.0, 1.5), kinds, strict=True)
    ]


def tasks_schedule(rng: random.Random, size: Size) -> list[Fault]:
    """One fault per business key (kill, pause while working, pause with the write in flight),
    then a forced rerun of one key; ``pick`` chooses among the runners working on it."""
    kinds = _balanced(rng, ["kill_runner", "pause_working", "pause_writing"], size.faults)
    faults = [
        Fault(0.0, kind, pick=rng.random(), wait=rng.uniform(0.0, 1.0), member=key)
        for key, kind in enumerate(kinds)
    ]
    faults.append(Fault(0.0, "force_rerun", pick=rng.random(), member=rng.randrange(size.faults)))
    return faults


def failover_schedule(rng: random.Random, size: Size) -> list[Fault]:
    """One failover: replication held up ``wait`` seconds, the primary killed, the standby
    promoted; a task runner works through it."""
    return [Fault(rng.uniform(1.0, 2.0), "pg_failover", wait=rng.uniform(1.0, 2.0))]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "kill",
            "SIGKILL mid-batch, before and after the Postgres commit",
            {
                "tiny": Size(messages=300, faults=1, rate=100),
                "short": Size(messages=900, faults=4),
                "full": Size(messages=3000, faults=10, partitions=4, consumers=3, rate=200),
            },
            kill_schedule,
        ),
        Scenario(
            "pause",
            "SIGSTOP past the session timeout, another takes over, SIGCONT",
            {
                "tiny": Size(messages=200, faults=1, partitions=2, rate=60),
                "short": Size(messages=600, faults=2, partitions=2, rate=60),
                "full": Size(messages=1500, faults=4, partitions=3, consumers=3, rate=80),
            },
            pause_schedule,
        ),
        Scenario(
            "kafka",
            "Kafka broker restarted (SIGTERM and kill -9) while consumers run",
            {
                "tiny": Size(messages=300, faults=1, rate=60),
                "short": Size(messages=300, faults=2, rate=60),
                "full": Size(messages=1000, faults=4, partitions=4, consumers=3, rate=80),
            },
            kafka_schedule,
        ),
        Scenario(
            "postgres",
            "Postgres crashed (pg_ctl stop -m immediate) and backends terminated mid-transaction",
            {
                "tiny": Size(messages=300, faults=1, rate=80),
                "short": Size(messages=900, faults=3, rate=100),
                "full": Size(messages=2500, faults=8, partitions=4, consumers=3, rate=120),
            },
            postgres_schedule,
            options=ConsumerOptions(hold=0.01),
        ),
        Scenario(
            "storm",
            "rebalance storm: members join and leave every few seconds; a handler slower than "
            "max.poll.interval.ms",
            {
                "tiny": Size(messages=300, faults=3, partitions=4, rate=60),
                "short": Size(messages=900, faults=7, partitions=4, rate=80),
                "full": Size(messages=2000, faults=13, partitions=6, consumers=3, rate=100),
            },
            storm_schedule,
            options=ConsumerOptions(max_poll_interval_ms=2500, idle_timeout_ms=9000),
        ),
        Scenario(
            "poison",
            "poison messages (bad JSON, no key, handler bug, conflicting payload) mixed in",
            {
                "tiny": Size(messages=300, faults=1, rate=100),
                "short": Size(messages=800, faults=2, rate=100),
                "full": Size(messages=2500, faults=6, partitions=4, consumers=3, rate=150),
            },
            poison_schedule,
            traffic=Traffic(poison=0.03),
        ),
        Scenario(
            "replay",
            "producer duplicates, then a full replay of the topic from the earliest offset",
            {
                "tiny": Size(messages=300, faults=1, rate=100),
                "short": Size(messages=800, faults=2, rate=100),
                "full": Size(messages=2500, faults=5, partitions=4, consumers=3, rate=150),
            },
            replay_schedule,
            traffic=Traffic(producer_duplicates=0.1, later_duplicates=0.05),
        ),
        Scenario(
            "hot_rows",
            "handlers update a few shared rows in offset order, unsorted, so lanes deadlock; "
            "kills and a pause",
            {
                "tiny": Size(messages=200, faults=1, rate=80),
                "short": Size(messages=300, faults=1, rate=100),
                "full": Size(messages=2000, faults=6, partitions=4, consumers=3, rate=120),
            },
            hot_rows_schedule,
            options=ConsumerOptions(handler="hot-rows"),
            traffic=Traffic(accounts=0.35),
        ),
        Scenario(
            "hang",
            "handlers that hang forever on some records, past handler_timeout; kills",
            {
                "tiny": Size(messages=200, faults=1, partitions=4, rate=80),
                "short": Size(messages=300, faults=2, partitions=4, rate=100),
                "full": Size(messages=1500, faults=6, partitions=6, consumers=3, rate=120),
            },
            hang_schedule,
            # handler_timeout is derived: 2.5 s idle timeout - the 2 s margin = 0.5 s.
            options=ConsumerOptions(handler="hang", idle_timeout_ms=2500),
        ),
        Scenario(
            "tasks",
            "task runners killed and paused mid-job while others race; a forced rerun",
            {
                "tiny": Size(messages=0, faults=1, consumers=2),
                "short": Size(messages=0, faults=3, consumers=3),
                "full": Size(messages=0, faults=9, consumers=4),
            },
            tasks_schedule,
            tasks=True,
        ),
        Scenario(
            "failover",
            "Postgres failover: the primary SIGKILLed with replication lagging, the "
            "asynchronous standby promoted; clients follow a multi-host DSN",
            {
                "tiny": Size(messages=400, faults=1, rate=100),
                "short": Size(messages=500, faults=1, rate=100),
                "full": Size(messages=1500, faults=1, partitions=4, consumers=3, rate=120),
            },
            failover_schedule,
            replica="async",
        ),
        Scenario(
            "failover_sync",
            "the same failover with a synchronous standby (synchronous_commit = on)",
            {
                "tiny": Size(messages=400, faults=1, rate=100),
                "full": Size(messages=1500, faults=1, partitions=4, consumers=3, rate=120),
            },
            failover_schedule,
            replica="sync",
        ),
    ]
}


def rng_for(scenario: str, seed: int, stream: str) -> random.Random:
    """The seeded random stream ``stream`` of a run (a string seed hashes alike everywhere)."""
    return random.Random(f"{scenario}:{seed}:{stream}")


def schedule(scenario: Scenario, seed: int, size: Size) -> list[Fault]:
    """The run's faults, in order."""
    return scenario.schedule(rng_for(scenario.name, seed, "faults"), size)


# ----------------------------------------------------------------- traffic --


@dataclass(frozen=True)
class Send:
    """One record to produce."""

    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    partition: int | None = None
    """None: by the Kafka key, as a producer does."""


POISON_KINDS = ("bad_json", "no_key", "explode", "conflict")


class Messages:
    """The run's records, the i-th always the same for a seed."""

    def __init__(self, scenario: Scenario, seed: int, partitions: int) -> None:
        self.traffic = scenario.traffic
        self.partitions = partitions
        self._rng = rng_for(scenario.name, seed, "messages")
        self._sent: list[Send] = []  # plain records, for later duplicates and conflicts
        self._i = 0

    def next(self) -> list[Send]:
        """The next records to send: one, or two for a producer-level duplicate."""
        i, rng, t = self._i, self._rng, self.traffic
        self._i += 1
        seq = ("chaos-seq", str(i).encode())
        roll = rng.random()
        if roll < t.poison:
            return [self._poison(i, seq)]
        roll -= t.poison
        if roll < t.later_duplicates and len(self._sent) > 20:
            old = rng.choice(self._sent[:-10])
            other = None
            if rng.random() < 0.5:
                other = rng.randrange(self.partitions)
            return [Send(old.key, old.value, (*old.headers, seq), other)]
        roll -= t.later_duplicates
        key = f"k{i}"
        body: dict[str, object] = {"id": key, "n": i, "amount": rng.randint(1, 100_000)}
        if rng.random() < t.accounts:
            body["account"] = rng.randrange(ACCOUNTS)
        send = Send(key.encode(), orjson.dumps(body), (seq, ("chaos-kind", b"plain")))
        self._sent.append(send)
        if roll < t.producer_duplicates:
            return [send, send]
        return [send]

    def _poison(self, i: int, seq: tuple[str, bytes]) -> Send:
        kind = self._rng.choice(POISON_KINDS)
        headers = (seq, ("chaos-kind", kind.encode()), ("x-repeat", b"1"), ("x-repeat", b"2"))
        if kind == "conflict" and len(self._sent) > 20:
            old = self._rng.choice(self._sent[:-10])
            body = orjson.loads(old.value)
            body.update(amount=body["amount"] + 1, conflict=True)
            return Send(old.key, orjson.dumps(body), headers)
        if kind == "bad_json":
            return Send(f"b{i}".encode(), b'{"id": "b' + str(i).encode() + b'", ', headers)
        if kind == "no_key":
            return Send(f"n{i}".encode(), orjson.dumps({"n": i, "amount": 1}), headers)
        return Send(f"p{i}".encode(), orjson.dumps({"id": f"p{i}", "explode": True}), headers)


def hang_record(index: int, partition: int) -> Send:
    """The record of the ``index``-th fault, a ``hang``: its handler awaits forever."""
    key = f"h{index}"
    body = {"id": key, "hang": True}
    return Send(key.encode(), orjson.dumps(body), (("chaos-kind", b"hang"),), partition)


def classify(value: bytes) -> tuple[str, str | None]:
    """(kind, idempotency key) of a record as the consumer will see it."""
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return "bad_json", None
    if not isinstance(doc, dict) or "id" not in doc:
        return "no_key", None
    if doc.get("explode"):
        return "explode", str(doc["id"])
    if doc.get("hang"):
        return "hang", str(doc["id"])
    if doc.get("conflict"):
        return "conflict", str(doc["id"])
    return "plain", str(doc["id"])
