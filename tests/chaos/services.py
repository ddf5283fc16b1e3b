"""The chaos suite's own Kafka and Postgres: the ones it stops, kills and restarts.

They are a second pair started by ``compose/local/up`` with ``DEDUP_SERVICES_DIR``
(default ``.services/chaos``, or ``CHAOS_SERVICES_DIR``), never the shared pair
of ``.services`` that other tests use at the same time.  The session that
starts them stops them at its end; a session nested inside another (the docs
test runs pytest again) uses the enclosing session's pair and leaves it running.

Postgres is configured with ``track_commit_timestamp = on``: the oracle orders
each write against the token history by commit time.

The broker has :data:`KAFKA_SLOTS` extra listeners (``CUT0``...), each advertising
the port of a proxy (:mod:`dedup_dev.proxy`): a client bootstrapped through the
proxy of slot k gets metadata, coordinator and leader addresses that all lead
back through it, so the network partitions of :mod:`tests.chaos.netsplit` cut it
off from Kafka there (``DEDUP_KAFKA_EXTRA_LISTENERS``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dedup_dev.services import ROOT, read_env

SCRIPTS = ROOT / "compose" / "local"
SHARED_DIR = ROOT / ".services"
DEFAULT_DIR = SHARED_DIR / "chaos"
PORT_OFFSET = int(os.environ.get("CHAOS_PORT_OFFSET") or 0)
"""``CHAOS_PORT_OFFSET``: added to every port below, so two checkouts can run the
suite side by side (each on its own ``.services/chaos``)."""
PORTS = {
    name: port + PORT_OFFSET
    for name, port in {
        "postgres/port": 25433,
        "kafka/port": 29094,
        "kafka/controller-port": 29095,
    }.items()
}
"""Far from 5432/9092: `up` elsewhere scans upwards from those for a free port, and
would take ours while a fault has our service down (then ours could not come back
on its port)."""
STANDBY_PORT = 25434 + PORT_OFFSET
"""The streaming standby of the failover scenarios (:mod:`tests.chaos.pg_failover`)."""
KAFKA_SLOTS = 4
"""Extra listeners of the chaos broker, one per process that can be cut off from Kafka
(:mod:`tests.chaos.netsplit`; the full matrix runs three consumers)."""
KAFKA_LISTENER_BASE = 29120
"""Port of the broker's listener ``CUT0`` (``CUT<k>``: this + k), plus ``CHAOS_PORT_OFFSET``."""
KAFKA_PROXY_BASE = 29130
"""Port the listener ``CUT0`` advertises (slot k's proxy listens there: this + k), plus the
offset."""


def kafka_listener_port(slot: int) -> int:
    """Where the chaos broker's listener of proxy slot ``slot`` listens."""
    return KAFKA_LISTENER_BASE + slot + PORT_OFFSET


def kafka_proxy_port(slot: int) -> int:
    """Where slot ``slot``'s proxy listens: the address its broker listener advertises."""
    return KAFKA_PROXY_BASE + slot + PORT_OFFSET


def kafka_extra_listeners() -> str:
    """``DEDUP_KAFKA_EXTRA_LISTENERS`` of the chaos broker: ``CUT<k>:PORT:ADVERTISED_PORT``."""
    return " ".join(
        f"CUT{k}:{kafka_listener_port(k)}:{kafka_proxy_port(k)}" for k in range(KAFKA_SLOTS)
    )


class ServicesError(Exception):
    """The chaos services could not be started, stopped or restarted."""


def _port(address: str) -> str:
    return address.rsplit(":", 1)[-1].split("/", 1)[0]


def script_env(directory: Path) -> dict[str, str]:
    """The environment for ``compose/local/*`` on ``directory``.

    ``KAFKA_BOOTSTRAP_SERVERS`` and ``DEDUP_DSN`` are removed: set, they would
    make ``up`` use the user's (or the shared) services instead of starting ours.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "DEDUP_DSN")}
    env["DEDUP_SERVICES_DIR"] = str(directory)
    return env


def chaos_env(directory: Path) -> dict[str, str]:
    """:func:`script_env`, and the broker's extra listeners for the proxies of
    :mod:`tests.chaos.netsplit` (a single broker only: the cluster has none)."""
    return {**script_env(directory), "DEDUP_KAFKA_EXTRA_LISTENERS": kafka_extra_listeners()}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class ChaosServices:
    """Where the chaos pair answers, and the faults that can be done to it."""

    directory: Path
    bootstrap_servers: str
    dsn: str
    owner: bool
    """True when this session started the pair (and stops it at the end)."""

    # ----------------------------------------------------------- lifecycle --

    @classmethod
    def start(cls, directory: Path) -> ChaosServices:
        """Start (or join) the pair under ``directory``; raise ServicesError with the reason."""
        directory = directory.resolve()
        if directory == SHARED_DIR.resolve():
            raise ServicesError(
                f"{directory} holds the shared services other tests use; the chaos suite "
                "restarts its services and needs its own directory (CHAOS_SERVICES_DIR)"
            )
        directory.mkdir(parents=True, exist_ok=True)
        owner_file = directory / "owner"
        enclosing = _enclosing_owner(owner_file)
        for name, port in PORTS.items():  # `up` reuses a saved port while it is free
            service = directory / name.split("/")[0]
            if not _service_alive(service):
                service.mkdir(parents=True, exist_ok=True)
                (directory / name).write_text(f"{port}\n")
        _restart_without_listeners(directory)
        run = subprocess.run(
            [SCRIPTS / "up"],
            env=chaos_env(directory),
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if run.returncode != 0:
            raise ServicesError(
                f"compose/local/up with DEDUP_SERVICES_DIR={directory} failed "
                f"(exit {run.returncode}):\n{run.stderr[-3000:]}"
            )
        services = cls(directory=directory, bootstrap_servers="", dsn="", owner=enclosing is None)
        services._load_addresses()
        if services.owner:
            owner_file.write_text(str(os.getpid()))
        services._ensure_commit_timestamps()
        return services

    def stop(self) -> None:
        """Stop the pair if this session started it."""
        if not self.owner:
            return
        subprocess.run(
            [SCRIPTS / "down"], env=chaos_env(self.directory), capture_output=True, check=False
        )
        (self.directory / "owner").unlink(missing_ok=True)

    def _load_addresses(self) -> None:
        """Take the addresses from the env file ``up`` wrote, and check they are ours."""
        env = read_env(self.directory / "env")
        self.bootstrap_servers = env.get("KAFKA_BOOTSTRAP_SERVERS", "")
        self.dsn = env.get("DEDUP_DSN", "")
        if not self.bootstrap_servers or not self.dsn:
            raise ServicesError(f"no addresses in {self.directory / 'env'}")
        shared = read_env(SHARED_DIR / "env")
        for name, ours in (
            ("KAFKA_BOOTSTRAP_SERVERS", self.bootstrap_servers),
            ("DEDUP_DSN", self.dsn),
        ):
            theirs = shared.get(name) or os.environ.get(name)
            if theirs and _port(theirs) == _port(ours):
                raise ServicesError(
                    f"the chaos {name}={ours} is the shared one ({theirs}); refusing to "
                    "restart services other tests use"
                )

    def _ensure_commit_timestamps(self) -> None:
        if self._psql("SHOW track_commit_timestamp") == "on":
            return
        conf = self.directory / "postgres" / "data" / "postgresql.conf"
        with conf.open("a") as f:  # not postgresql.auto.conf: `up` rewrites that one
            f.write("\n# chaos suite: order writes by commit time\ntrack_commit_timestamp = on\n")
        for action in (["down", "postgres"], ["up", "postgres"]):
            self._script_sync(*action)
        if self._psql("SHOW track_commit_timestamp") != "on":
            raise ServicesError("could not turn on track_commit_timestamp on the chaos Postgres")

    def _psql(self, sql: str) -> str:
        return _run([pg_bin() / "psql", self.dsn, "-Atqc", sql], f"psql {sql!r}", timeout=30)

    def _script_sync(self, name: str, *args: str) -> None:
        argv = [SCRIPTS / name, *args]
        _run(argv, f"compose/local/{name} {' '.join(args)}", env=chaos_env(self.directory))

    # -------------------------------------------------------------- faults --

    async def _script(self, name: str, *args: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            str(SCRIPTS / name),
            *args,
            env=chaos_env(self.directory),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise ServicesError(f"compose/local/{name} {' '.join(args)} failed:\n{err.decode()}")

    async def stop_kafka(self, *, kill: bool) -> None:
        """Stop the broker: SIGTERM (a clean shutdown), or SIGKILL with ``kill``."""
        await self._script("down", *(["--kill"] if kill else []), "kafka")

    async def start_kafka(self) -> None:
        """Start the broker; return once it answers a metadata request."""
        await self._script("up", "kafka")
        self._same_address("KAFKA_BOOTSTRAP_SERVERS", self.bootstrap_servers)

    async def crash_postgres(self) -> None:
        """``pg_ctl stop -m immediate``: every backend dies, open transactions are lost."""
        data = self.directory / "postgres" / "data"
        argv = [str(pg_bin() / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise ServicesError(f"pg_ctl stop -m immediate failed: {err.decode()}")
        # The postmaster lingers as a zombie until init reaps it, and `up` takes a
        # live pid for a running server: wait until it is really gone.
        pid = int((self.directory / "postgres" / "pid").read_text().strip())
        for _ in range(600):
            if not pid_alive(pid):
                return
            await asyncio.sleep(0.05)
        raise ServicesError(f"the crashed postmaster (pid {pid}) did not go away in 30 s")

    async def heal(self) -> None:
        """Start whichever of the pair is down (after a run that failed halfway).

        A service that came back on another port (its own was taken while it was
        down) is followed: the next runs use the new address.
        """
        await self._script("up")
        self._load_addresses()

    async def start_postgres(self) -> None:
        """Start Postgres again (crash recovery runs first)."""
        await self._script("up", "postgres")
        self._same_address("DEDUP_DSN", self.dsn)

    def _same_address(self, name: str, expected: str) -> None:
        now = read_env(self.directory / "env").get(name, "")
        if _port(now) != _port(expected):
            raise ServicesError(
                f"after the restart {name} moved from {expected} to {now} (the port was "
                "taken meanwhile); clients can't follow, so this run can't go on"
            )


def _run(
    argv: list[Path | str], what: str, *, env: dict[str, str] | None = None, timeout: float = 300
) -> str:
    """Run ``argv`` to its end; its stdout, or ServicesError saying ``what`` failed."""
    run = subprocess.run(
        argv, env=env, capture_output=True, text=True, check=False, timeout=timeout
    )
    if run.returncode != 0:
        raise ServicesError(f"{what} on the chaos services failed:\n{run.stderr}")
    return run.stdout.strip()


def pg_bin() -> Path:
    """The newest ``/usr/lib/postgresql/*/bin``."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name or 0))
    if not found:
        raise ServicesError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin)")
    return found[-1]


def _restart_without_listeners(directory: Path) -> None:
    """Stop a running chaos broker started without the proxies' listeners (by an older
    checkout): ``up`` leaves a running broker as it is, so it would keep lacking them."""
    properties = directory / "kafka" / "server.properties"
    if not _service_alive(directory / "kafka") or not properties.exists():
        return
    if f"CUT0://127.0.0.1:{kafka_listener_port(0)}" in properties.read_text():
        return
    _run([SCRIPTS / "down", "kafka"], "compose/local/down kafka", env=chaos_env(directory))


def _service_alive(service: Path) -> bool:
    """Whether the pid ``up`` recorded for a service is alive."""
    try:
        return pid_alive(int((service / "pid").read_text().strip()))
    except (OSError, ValueError):
        return False


def _enclosing_owner(owner_file: Path) -> int | None:
    """The pid of a live session that started the pair, if not this process."""
    try:
        pid = int(owner_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid == os.getpid() or not pid_alive(pid):
        return None
    return pid
