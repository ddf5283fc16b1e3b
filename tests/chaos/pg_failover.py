"""A Postgres failover in the chaos suite: a streaming standby, the primary killed, promotion.

Each run of a failover scenario makes its own standby of the chaos Postgres
with ``pg_basebackup -R`` (streaming replication, no slot) on
:data:`~tests.chaos.services.STANDBY_PORT`, asynchronous by default or, for
``replica="sync"``, named in the primary's ``synchronous_standby_names``
(``synchronous_commit`` stays ``on``).  Every client of the run, the consumer
children, a task runner and the driver, connects through the multi-host DSN
``postgresql://postgres@127.0.0.1:PRIMARY,127.0.0.1:STANDBY/db?target_session_attrs=read-write``
and none is restarted.

The fault (``pg_failover``):

1. replication is held up: the primary's walsender is SIGSTOPped, as a slow
   network would, for ``Fault.wait`` seconds.  With an asynchronous standby
   the primary goes on committing what the standby never receives; with a
   synchronous one every COMMIT waits for the standby;
2. a task runner starts meanwhile (its lease lives in the primary only) and
   works through the whole failover;
3. the primary dies as a machine does: all its processes SIGSTOPped, then
   SIGKILLed;
4. the standby is promoted (``pg_ctl promote``).  The clients' connections
   broke; their next ones find the new primary through the DSN.

The consumer children log every COMMIT that returned (``--log-commits``); after
the run those acknowledged batches missing from the promoted server's
``chaos_batches`` are the **committed transactions the failover lost**, and
each of their records must have been applied again, exactly once.

After the run the promoted standby is stopped and deleted, and the old
primary, which never came back during the run, is started again as it was
(its own timeline, the lost transactions included) by the fixture's ``heal``:
the next run makes a fresh standby from it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from dedup_dev import helpers
from dedup_dev.children import Child
from dedup_dev.services import read_env
from tests.chaos import driver, oracle, scenarios
from tests.chaos.services import STANDBY_PORT, ChaosServices, ServicesError, pg_bin, pid_alive

STANDBY_NAME = "chaos_standby"
"""The standby's ``cluster_name``: the name its walreceiver reports to the primary."""


def as_postgres(argv: list[str]) -> list[str]:
    """Postgres' tools refuse to run as root: as root, run them as the postgres user."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


async def _run(argv: list[str], what: str, within: float = 120) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within)
    except TimeoutError:
        proc.kill()
        raise ServicesError(f"{what} took longer than {within:.0f}s") from None
    if proc.returncode != 0:
        raise ServicesError(f"{what} failed (exit {proc.returncode}):\n{err.decode()[-2000:]}")
    return out.decode().strip()


def multi_host(dsn: str, *ports: int) -> str:
    """``dsn`` (a URL on 127.0.0.1) with every one of ``ports`` as a host, read-write only."""
    database = dsn.rsplit("/", 1)[1].split("?", 1)[0]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


@dataclass
class Standby:
    """The run's streaming standby, and the primary it follows."""

    services: ChaosServices
    directory: Path
    synchronous: bool

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{STANDBY_PORT}/postgres"

    @classmethod
    async def create(cls, services: ChaosServices, *, synchronous: bool) -> Standby:
        """``pg_basebackup -R`` of the chaos Postgres, started, streaming (and synchronous)."""
        standby = cls(services, services.directory / "standby", synchronous)
        await standby.discard()
        standby.directory.mkdir(parents=True)
        _own(standby.directory)
        primary = read_env(services.directory / "env")["DEDUP_DSN"]
        bin_ = pg_bin()
        await _run(
            as_postgres(
                [
                    *(str(bin_ / "pg_basebackup"), "-d", primary, "-D", str(standby.data)),
                    *("-R", "-X", "stream", "-c", "fast", "--no-sync"),
                ]
            ),
            "pg_basebackup of the chaos Postgres",
        )
        run = standby.directory / "run"
        run.mkdir()
        _own(run)
        with (standby.data / "postgresql.auto.conf").open("a") as conf:
            # Later lines win over the primary's port and socket copied with the backup.
            conf.write(
                f"\n# chaos standby\nport = {STANDBY_PORT}\nunix_socket_directories = '{run}'\n"
                f"cluster_name = '{STANDBY_NAME}'\nshared_buffers = 32MB\n"
            )
        await _run(
            as_postgres(
                [
                    *(str(bin_ / "pg_ctl"), "-D", str(standby.data)),
                    *("-l", str(standby.directory / "server.log"), "-w", "-t", "60", "start"),
                ]
            ),
            "starting the standby",
        )
        conn = await asyncpg.connect(primary)
        try:
            if synchronous:
                await conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
                await conn.execute("SELECT pg_reload_conf()")

            async def streaming() -> bool:
                state = await conn.fetchrow(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
                    STANDBY_NAME,
                )
                want = "sync" if synchronous else "async"
                return state is not None and tuple(state) == ("streaming", want)

            await helpers.wait_for(streaming, within=60, what="the standby to stream")
        finally:
            await conn.close()
        return standby

    async def hold_replication(self) -> int:
        """SIGSTOP the primary's walsender: nothing more reaches the standby. Its pid."""
        conn = await asyncpg.connect(read_env(self.services.directory / "env")["DEDUP_DSN"])
        try:
            pid = await conn.fetchval(
                "SELECT pid FROM pg_stat_replication WHERE application_name = $1", STANDBY_NAME
            )
        finally:
            await conn.close()
        if pid is None:
            raise ServicesError("the standby is not streaming from the primary")
        os.kill(pid, signal.SIGSTOP)
        return int(pid)

    async def kill_primary(self) -> None:
        """The primary dies as its machine would: every process stopped, then killed."""
        pid = int((self.services.directory / "postgres" / "pid").read_text().strip())
        os.kill(pid, signal.SIGSTOP)  # it restarts no child meanwhile
        every = [pid, *_children_of(pid)]
        for p in every:
            os.kill(p, signal.SIGSTOP)
        for p in every:
            os.kill(p, signal.SIGKILL)
        for _ in range(600):
            # Gone, and the postmaster reaped too: until then its pid answers, and a
            # Postgres started on its data directory sees the lock file as held.
            if not any(_alive(p) for p in every) and not pid_alive(pid):
                return
            await asyncio.sleep(0.05)
        raise ServicesError(f"the killed primary (pid {pid}) did not go away in 30 s")

    async def promote(self) -> None:
        """``pg_ctl promote``, waiting until the standby takes writes."""
        await _run(
            as_postgres([str(pg_bin() / "pg_ctl"), "-D", str(self.data), "-w", "promote"]),
            "promoting the standby",
        )

    async def discard(self) -> None:
        """Put the primary back to no standby (if it is alive), stop the standby, delete it."""
        primary = read_env(self.services.directory / "env").get("DEDUP_DSN", "")
        if self.synchronous:
            try:
                conn = await asyncpg.connect(primary, timeout=5)
            except (OSError, asyncpg.PostgresError, TimeoutError):
                pass  # dead: `up` rewrites postgresql.auto.conf when it starts it
            else:
                try:
                    await conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
                    await conn.execute("SELECT pg_reload_conf()")
                finally:
                    await conn.close()
        pidfile = self.data / "postmaster.pid"
        if pidfile.exists():
            pid = int(pidfile.read_text().split()[0])
            if _alive(pid):
                os.kill(pid, signal.SIGQUIT)  # immediate shutdown: its data goes anyway
                for _ in range(600):
                    if not _alive(pid):
                        break
                    await asyncio.sleep(0.05)
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class Commit:
    """A batch whose COMMIT returned to its consumer."""

    partition: int
    token: int
    first: int
    next: int


class FailoverRun(driver.ConsumerRun):
    """A consumer run against a primary with a standby, struck by ``pg_failover``."""

    def __init__(
        self,
        ctx: driver.RunContext,
        scenario: scenarios.Scenario,
        seed: int,
        matrix: str,
        broken: str | None = None,
    ) -> None:
        super().__init__(ctx, scenario, seed, matrix, broken)
        self.synchronous = scenario.replica == "sync"
        self.standby: Standby | None = None
        self.member_args = ["--log-commits"]
        self.task = f"chaos_failover_{seed}_{self.group[-6:]}"
        self.task_key = "2026-01-01"

    async def execute(self) -> Any:
        t0 = time.monotonic()
        self.standby = await Standby.create(self.ctx.services, synchronous=self.synchronous)
        kind = "synchronous" if self.synchronous else "asynchronous"
        self.note(f"{kind} standby streaming after {time.monotonic() - t0:.1f}s")
        primary = int(self.ctx.dsn.rsplit(":", 1)[1].split("/", 1)[0])
        self.ctx = driver.RunContext(
            self.ctx.services, multi_host(self.ctx.dsn, primary, STANDBY_PORT), self.ctx.logs
        )
        result = await super().execute()
        await self.account_for_commits()
        async with self.pool.acquire() as conn:
            verdict = await oracle.check_task_run(conn, self.task, [self.task_key], None)
        result.lost += verdict.lost
        result.doubled += verdict.doubled
        result.stale_committed += verdict.stale_committed
        result.violations.extend(f"task runner: {v}" for v in verdict.violations)
        return result

    async def runner(self, name: str, work: float) -> Child:
        args = [
            *("--dsn", self.ctx.dsn, "--task", self.task, "--key", self.task_key),
            *("--holder", name, "--ttl", "2", "--work", f"{work:.2f}"),
        ]
        child = await Child.start("tests.chaos.task_child", args, name=name, logs=self.ctx.logs)
        self.children.append(child)
        return child

    async def inject_other(self, f: scenarios.Fault) -> None:
        if f.kind != "pg_failover":
            await super().inject_other(f)
        assert self.standby is not None
        walsender = await self.standby.hold_replication()
        self.note(f"replication held up (walsender {walsender} stopped) for {f.wait:.1f}s")
        held = time.monotonic()
        # Its lease is taken while replication is held: it lives in the primary only
        # (with a synchronous standby the taking waits, and fails with the primary).
        runner = await self.runner("r0", work=f.wait + 2.0)
        await asyncio.sleep(max(0.0, held + f.wait - time.monotonic()))
        working = any(line.startswith("WORKING") for line in runner.lines)
        self.note(f"task runner r0 {'working' if working else 'not started yet'}")
        await self.standby.kill_primary()
        dead = time.monotonic()
        self.note("primary killed (every process SIGKILLed)")
        await self.standby.promote()
        promoted = time.monotonic()
        self.note(f"standby promoted in {promoted - dead:.1f}s")
        self.watch("failover", promoted, await self.offsets_of(None))
        # The scheduler fires the task again on its next tick, as it would after an outage.
        await asyncio.sleep(1.0)
        again = await self.runner("r1", work=0.5)
        for c in (runner, again):
            await c.wait(within=90)

    def acknowledged(self) -> list[Commit]:
        return [
            Commit(*(int(x) for x in line.split()[1:5]))
            for c in self.children
            for line in c.lines
            if line.startswith("COMMITTED ")
        ]

    async def account_for_commits(self) -> None:
        """Count the acknowledged commits the failover lost; each of their records must have
        been applied again, exactly once."""
        acked = self.acknowledged()
        rows = await self.q(
            lambda p: p.fetch('SELECT "partition", token, first_offset FROM chaos_batches')
        )
        kept = {(r["partition"], r["token"], r["first_offset"]) for r in rows}
        lost = [c for c in acked if (c.partition, c.token, c.first) not in kept]
        records = await oracle.read_topic(self.bootstrap, self.topic, self.size.partitions)
        keys = {
            r.ident
            for c in lost
            for r in records
            if r.partition == c.partition and c.first <= r.offset < c.next and r.kind == "plain"
        }
        applied = dict(
            await self.q(
                lambda p: p.fetch(
                    "SELECT key, count(*) FROM chaos_effects WHERE key = any($1::text[])"
                    " GROUP BY key",
                    sorted(k for k in keys if k is not None),
                )
            )
        )
        once = sum(1 for k in keys if applied.get(k) == 1)
        self.result.lost_commits = len(lost)
        self.result.reapplied = once
        self.note(
            f"{len(acked)} commits acknowledged, {len(lost)} lost in the failover; "
            f"their {len(keys)} records applied again exactly once: {once}"
        )
        if once != len(keys):
            self.violation(
                f"{len(keys) - once} records of the lost commits are not applied exactly once"
            )
        if self.synchronous and lost:
            self.violation(f"a synchronous standby lost {len(lost)} acknowledged commits")
        if not self.synchronous and not lost and self.broken is None:
            self.violation("the failover lost no acknowledged commit: the fault did not bite")

    async def close(self) -> None:
        await super().close()
        if self.standby is not None:
            await self.standby.discard()
