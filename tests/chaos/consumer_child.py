"""A consumer of the chaos suite, in its own process, with failpoints the driver arms.

    python -m tests.chaos.consumer_child --dsn DSN --bootstrap-servers HOST:PORT \
        --topic T --group G --holder H [--batch-size N] [--hold SECONDS] \
        [--session-timeout-ms MS] [--max-poll-interval-ms MS] [--idle-timeout-ms MS] \
        [--handler plain|hot-rows|hang] [--log-commits]

It runs ``dedup.IdempotentConsumer`` with a batch handler that writes one
``chaos_effects`` row per applied message: key, partition, offset, and the
token and holder it ran under.  Every committed batch also leaves a
``chaos_batches`` row in its own transaction, so the oracle can check the token
of every transaction that moved an offset, not only of those that applied
something.  ``--handler`` adds what real handlers do:

``hot-rows``  then adds the amount of each message that names an account to
              that account's balance (``chaos_accounts``, a few rows every
              partition shares), one UPDATE per message in offset order,
              unsorted: the lanes of one consumer and those of several
              deadlock each other
``hang``      a message with ``"hang": true`` makes the handler await forever
              (after its batch's writes, which must roll back); each attempt
              is logged in ``chaos_hangs`` on a connection of its own

Commands on stdin, one a line, arm a failpoint for the next batch:

``before_commit``  SIGKILL itself after the batch's writes, before COMMIT
``after_commit``   SIGKILL itself right after COMMIT, before anything else
``pause``          SIGSTOP itself after the batch's writes (the driver sends SIGCONT)
``pause_before_begin``  SIGSTOP itself with a turn's records taken, before its
                   transaction begins (nothing locked; after SIGCONT the turn
                   goes on under the token it had)
``slow SECONDS``   the handler works SECONDS, longer than ``max.poll.interval.ms``
``hold WHERE``     stop the next batch at WHERE until ``release`` comes (the process goes
                   on: the driver cuts its network meanwhile): ``before_begin``, with a
                   turn's records taken (nothing sent yet); ``before_commit``, after
                   the batch's writes; ``in_handler``, after the handler's write, which
                   then sends one more statement on ``tx.conn``
``release``        let the held batch go on

Lines on stdout: ``READY <holder>``, ``FAILPOINT <what> <partition> <offset>
<token>`` right before it strikes (``hold_<where>`` once a batch is held),
``HANG <partition> <offset> <token>`` when the handler starts to hang,
``STATS <json>`` on a clean exit (SIGTERM); with ``--log-commits``,
``COMMITTED <partition> <token> <first offset> <next offset>`` once a batch's
COMMIT returned (its ``chaos_batches`` row is acknowledged).

``CHAOS_BREAK`` builds a deliberately broken consumer, for the suite's teeth:

``no_fence``      the fence passes whatever the token and the stored offset (in
                  the batch's claim and in the offset moves past records never
                  handed out), and the consumer's periodic look for a newer
                  token in ``dedup.partitions`` is off
``offset_first``  the offset is stored (and committed) before the batch's writes
``outside_tx``    the handler writes through its own connection, not ``tx.conn``
``kafka_offsets`` the offset the consumer goes on from is its own position, as
                  if committed to Kafka: where Postgres' stored offset is behind
                  it (a failover lost commits), it is set forward to it first
``no_idle_timeout`` the consumer's transactions run without
                  ``idle_in_transaction_session_timeout`` (set to 0 after each fence):
                  the server never ends the session of a member cut off mid-transaction,
                  whose locks stay until the network heals

The batch log, the failpoints and the breaks are hooks at the library's fault
points (:mod:`dedup._faults`); nothing of the library is patched.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

import orjson

import dedup
from dedup import _config as config_
from dedup import _faults as faults
from dedup import _store as store
from dedup.consumer import _consumer as consumer_
from dedup.data import _db as db
from dedup_dev import children
from tests.chaos import scenarios

EFFECTS = f"""
CREATE TABLE IF NOT EXISTS chaos_effects (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key         text   NOT NULL,
    "partition" int    NOT NULL,
    "offset"    bigint NOT NULL,
    token       bigint NOT NULL,
    holder      text   NOT NULL
);
CREATE TABLE IF NOT EXISTS chaos_batches (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    "partition"  int    NOT NULL,
    token        bigint NOT NULL,
    holder       text   NOT NULL,
    first_offset bigint NOT NULL,
    next_offset  bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS chaos_accounts (
    account int    PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0
);
INSERT INTO chaos_accounts (account)
SELECT generate_series(0, {scenarios.ACCOUNTS - 1}) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS chaos_hangs (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    "partition" int         NOT NULL,
    "offset"    bigint      NOT NULL,
    token       bigint      NOT NULL,
    holder      text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
"""The business tables (no unique key on the effects: a message applied twice shows
as two rows; the hot rows of ``--handler hot-rows``), the log of committed
batches and the log of hung handler calls (committed on their own)."""

HANDLERS = ("plain", "hot-rows", "hang")

BREAKS = ("no_fence", "offset_first", "outside_tx", "kafka_offsets", "no_idle_timeout")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


STRIKES: dict[str, tuple[str, signal.Signals]] = {
    "before_commit": ("before_commit", signal.SIGKILL),
    "after_commit": ("after_commit", signal.SIGKILL),
    "pause": ("before_commit", signal.SIGSTOP),
    "pause_before_begin": ("before_begin", signal.SIGSTOP),
}
"""What the driver may arm: where it strikes, and the signal it sends this process."""


HOLDS = ("before_begin", "before_commit", "in_handler")
"""Where ``hold WHERE`` stops a batch."""


class Failpoints:
    """What the driver armed for the next batch."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.slow = 0.0
        self.hold: str | None = None
        self._released = asyncio.Event()

    async def held(self, where: str, partition: int, offset: int, token: int) -> bool:
        """Wait for ``release`` if a hold was armed at ``where``; True if it was."""
        if self.hold != where:
            return False
        self.hold = None
        self._released.clear()
        say(f"FAILPOINT hold_{where} {partition} {offset} {token}")
        await self._released.wait()
        return True

    def strike(self, when: str, partition: int, offset: int, token: int) -> None:
        """Kill or stop this process if what was armed strikes at ``when``."""
        where, sig = STRIKES.get(self.armed or "", ("", signal.SIGKILL))
        if where != when:
            return
        what, self.armed = self.armed, None
        say(f"FAILPOINT {what} {partition} {offset} {token}")
        os.kill(os.getpid(), sig)

    async def listen(self) -> None:
        """Read commands from stdin until it closes."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := (await reader.readline()).decode().split():
            if line[0] == "slow":
                self.slow = float(line[1])
            elif line[0] == "hold" and line[1] in HOLDS:
                self.hold = line[1]
            elif line[0] == "release":
                self._released.set()
            else:
                self.armed = line[0]


def install(failpoints: Failpoints, holder: str, *, log_commits: bool = False) -> None:
    """Hook the consumer's batch transactions: the batch log and the failpoints."""

    async def before_begin(*, parts: Any, **_: Any) -> None:
        part = next((p for p in parts if p.size), None)
        if part is None:
            return
        first = min(m.offset for m in [*part.msgs, *(d.msg for d in part.dead)])
        await failpoints.held("before_begin", part.partition, first, part.fence.token)
        if failpoints.armed == "pause_before_begin":
            failpoints.strike("before_begin", part.partition, first, part.fence.token)

    async def before_commit(
        *, conn: Any, fence: store.Fence, msgs: Any, dead: Any, result: store.BatchResult
    ) -> None:
        every = [*msgs, *(d.msg for d in dead)]
        first = min(m.offset for m in every)
        await conn.execute(
            'INSERT INTO chaos_batches ("partition", token, holder, first_offset, next_offset)'
            " VALUES ($1, $2, $3, $4, $5)",
            every[0].partition,
            fence.token,
            holder,
            first,
            result.next_offset,
        )
        await failpoints.held("before_commit", every[0].partition, first, fence.token)
        failpoints.strike("before_commit", every[0].partition, first, fence.token)

    async def after_commit(
        *, fence: store.Fence, msgs: Any, dead: Any, result: store.BatchResult, **_: Any
    ) -> None:
        every = [*msgs, *(d.msg for d in dead)]
        first = min(m.offset for m in every)
        if log_commits:
            say(f"COMMITTED {every[0].partition} {fence.token} {first} {result.next_offset}")
        failpoints.strike("after_commit", every[0].partition, first, fence.token)

    faults.install(faults.Point.BEFORE_BEGIN, before_begin)
    faults.install(faults.Point.BEFORE_COMMIT, before_commit)
    faults.install(faults.Point.AFTER_COMMIT, after_commit)


def unfence() -> None:
    """``no_fence``: every fence passes, whatever the token and the stored offset.

    Just before the fencing statement, in its transaction, the partition's row is
    set to what this fence expects (this token, the offset it last stored); just
    after, the row gets back the newest token.  Net effect, as of a consumer that
    never checks: the offset moves, the token stays the newest owner's.  The
    periodic owner look (which would notice the newer token and stop this owner
    on its own) fails every time.
    """
    newest: dict[tuple[str, int], int] = {}

    async def pass_the_fence(
        *, conn: Any, fence: store.Fence, topic: str, partition: int, **_: Any
    ) -> None:
        row = (fence.group_id, topic, partition)
        newest[(topic, partition)] = await conn.fetchval(
            "SELECT token FROM dedup.partitions"
            ' WHERE group_id = $1 AND topic = $2 AND "partition" = $3 FOR UPDATE',
            *row,
        )
        await conn.execute(
            "UPDATE dedup.partitions SET token = $4, next_offset = $5"
            ' WHERE group_id = $1 AND topic = $2 AND "partition" = $3',
            *row,
            fence.token,
            fence.expected,
        )

    async def restore_the_token(
        *, conn: Any, fence: store.Fence, topic: str, partition: int, **_: Any
    ) -> None:
        await conn.execute(
            "UPDATE dedup.partitions SET token = greatest(token, $4)"
            ' WHERE group_id = $1 AND topic = $2 AND "partition" = $3',
            fence.group_id,
            topic,
            partition,
            newest.pop((topic, partition), None),
        )

    async def no_owner_look(**_: Any) -> None:
        raise ConnectionRefusedError("CHAOS_BREAK=no_fence: the owner look is off")

    faults.install(faults.Point.BEFORE_FENCE, pass_the_fence)
    faults.install(faults.Point.AFTER_FENCE, restore_the_token)
    faults.install(faults.Point.OWNER_LOOK, no_owner_look)


def offset_first(pool: Any) -> None:
    """``offset_first``: the classic mistake, the offset is stored (and committed) first.

    Just before the batch's fence, the offset moves to the batch's end on a
    connection of its own, which commits at once; then the batch's row is set
    back, in the batch's transaction, to what its fence expects.
    """

    async def store_the_offset_first(
        *, conn: Any, fence: store.Fence, topic: str, partition: int, next_offset: int, **_: Any
    ) -> None:
        moved = (
            "UPDATE dedup.partitions SET next_offset = $1"
            ' WHERE group_id = $2 AND topic = $3 AND "partition" = $4 AND token = $5'
        )
        where = (fence.group_id, topic, partition, fence.token)
        await pool.execute(moved, next_offset, *where)
        await conn.execute(moved, fence.expected, *where)

    faults.install(faults.Point.BEFORE_FENCE, store_the_offset_first)


def offsets_in_kafka() -> None:
    """``kafka_offsets``: the consumer goes on from its own position, not Postgres' offset.

    What a consumer that commits its offsets to Kafka does: after a failover
    that lost its last transactions, Postgres' offset is behind, Kafka's is
    not, and it resumes from Kafka's.  Here, just before the fence, in the
    batch's transaction, a stored offset behind the fence's is set forward
    to it, so the fence passes and nothing is consumed again.
    """

    async def trust_the_position(
        *, conn: Any, fence: store.Fence, topic: str, partition: int, **_: Any
    ) -> None:
        await conn.execute(
            "UPDATE dedup.partitions SET next_offset = $1, token = greatest(token, $5)"
            ' WHERE group_id = $2 AND topic = $3 AND "partition" = $4'
            " AND token <= $5 AND next_offset < $1",
            fence.expected,
            fence.group_id,
            topic,
            partition,
            fence.token,
        )

    faults.install(faults.Point.BEFORE_FENCE, trust_the_position)


def no_idle_timeout() -> None:
    """``no_idle_timeout``: after each fence (whose statement sets the timeout for its
    transaction), the transaction's idle-in-transaction timeout is turned off again."""

    async def keep_the_session(*, conn: Any, **_: Any) -> None:
        await conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")

    faults.install(faults.Point.AFTER_FENCE, keep_the_session)


async def main(args: argparse.Namespace) -> None:
    broken = os.environ.get("CHAOS_BREAK") or None
    if broken not in (None, *BREAKS):
        raise SystemExit(f"CHAOS_BREAK={broken!r}: expected one of {', '.join(BREAKS)}")
    failpoints = Failpoints()
    install(failpoints, args.holder, log_commits=args.log_commits)
    pool = await db.create_pool(
        args.dsn,
        min_size=1,
        max_size=config_.DEFAULT_CONCURRENCY + 1,  # a lane per partition in flight, one spare
        server_settings={
            "idle_in_transaction_session_timeout": (
                "0" if broken == "no_idle_timeout" else str(args.idle_timeout_ms)
            ),
            "application_name": f"chaos:{args.holder}",
        },
    )

    async def handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        for m in msgs:
            if m.json().get("explode"):
                raise RuntimeError(f"handler bug on {m.idempotency_key}")
        # The classic mistake of outside_tx: a write that commits on its own.
        writer = pool if broken == "outside_tx" else tx.conn
        await writer.execute(
            'INSERT INTO chaos_effects (key, "partition", "offset", token, holder)'
            " SELECT k, p, o, $4, $5"
            " FROM unnest($1::text[], $2::int[], $3::bigint[]) AS x(k, p, o)",
            [m.idempotency_key for m in msgs],
            [m.partition for m in msgs],
            [m.offset for m in msgs],
            tx.token,
            args.holder,
        )
        if await failpoints.held("in_handler", msgs[0].partition, msgs[0].offset, tx.token):
            await tx.conn.execute("SELECT 1")  # the handler's next statement, after the cut
        if args.handler == "hot-rows":
            # What the README's payment handler does, in offset order: two batches
            # that touch the same accounts in another order deadlock.
            for m in msgs:
                body = m.json()
                if "account" not in body:
                    continue
                await writer.execute(
                    "UPDATE chaos_accounts SET balance = balance + $2 WHERE account = $1",
                    body["account"],
                    body["amount"],
                )
                await asyncio.sleep(0.002)  # a call out between two updates, rows held
        if args.handler == "hang":
            hung = next((m for m in msgs if m.json().get("hang")), None)
            if hung is not None:
                # Logged outside the transaction, which the cancellation rolls back.
                await pool.execute(
                    'INSERT INTO chaos_hangs ("partition", "offset", token, holder)'
                    " VALUES ($1, $2, $3, $4)",
                    hung.partition,
                    hung.offset,
                    tx.token,
                    args.holder,
                )
                say(f"HANG {hung.partition} {hung.offset} {tx.token}")
                await asyncio.Event().wait()  # forever: only handler_timeout ends it
        if failpoints.slow:
            seconds, failpoints.slow = failpoints.slow, 0.0
            say(f"SLOW {msgs[0].partition} {msgs[0].offset} {tx.token} {seconds}")
            await asyncio.sleep(seconds)  # the handler's slow work, inside the transaction
        if args.hold:
            await asyncio.sleep(args.hold)

    consumer = dedup.IdempotentConsumer(
        handler,
        topics=[args.topic],
        group_id=args.group,
        bootstrap_servers=args.bootstrap_servers,
        pool=pool,
        key=dedup.keys.json_field("id"),
        batch=True,
        batch_size=args.batch_size,
        holder=args.holder,
        auto_offset_reset="earliest",
        session_timeout_ms=args.session_timeout_ms,
        heartbeat_interval_ms=max(args.session_timeout_ms // 6, 100),
        max_poll_interval_ms=args.max_poll_interval_ms,
        request_timeout_ms=10_000,
        shutdown_timeout=20.0,
        # The server cuts a paused member's session after --idle-timeout-ms; the
        # handler's deadline stays inside it.
        handler_timeout=max(args.idle_timeout_ms / 1000 - consumer_.IDLE_MARGIN, 0.5),
    )
    if broken == "no_fence":
        unfence()
    elif broken == "offset_first":
        offset_first(pool)
    elif broken == "kafka_offsets":
        offsets_in_kafka()
    elif broken == "no_idle_timeout":
        no_idle_timeout()
    listener = asyncio.create_task(failpoints.listen())
    say(f"READY {args.holder}")
    try:
        await consumer.run()
    finally:
        listener.cancel()
        say("STATS " + orjson.dumps(dict(consumer.stats)).decode())
        await pool.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = children.consumer_parser(prog="consumer_child")
    p.add_argument("--holder", required=True)
    p.add_argument("--batch-size", type=int, default=25)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--session-timeout-ms", type=int, default=3000)
    p.add_argument("--max-poll-interval-ms", type=int, default=300_000)
    p.add_argument("--idle-timeout-ms", type=int, default=4000)
    p.add_argument("--handler", choices=HANDLERS, default="plain")
    p.add_argument("--log-commits", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("dedup").setLevel(logging.INFO)  # deadlocks, splits, takeovers
    asyncio.run(main(parse()))
