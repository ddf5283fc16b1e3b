"""Kafka faults on a three-broker KRaft cluster: the cluster, its scenarios, their table.

The cluster is started by ``DEDUP_KAFKA_BROKERS=3 compose/local/up kafka`` under
``CHAOS_CLUSTER_DIR`` (default ``.services/chaos-cluster``) on fixed ports
29111-29116, far from the single-node chaos pair's; the chaos Postgres is the
one of :mod:`tests.chaos.services`.  Each node is a combined broker and
controller; topics have three replicas and ``min.insync.replicas=2``, and the
producer sends with ``acks=all``.

The consumer runs are :class:`tests.chaos.driver.ConsumerRun` with the same
consumer children and the same oracle; only the faults differ (``Fault.kind``):

``leader_kill``       SIGKILL the broker that leads partition ``pick`` of the run's topic
``broker_restart``    SIGTERM (a clean shutdown) node ``member``; a rolling restart is
                      one per node, each after the previous is back in every ISR
``controller_kill``   SIGKILL the active controller (the quorum's leader, as
                      ``kafka-metadata-quorum describe --status`` names it)
``broker_pause``      SIGSTOP the leader of partition ``pick`` until the cluster has
                      fenced it and every partition moved on, ``wait`` more, SIGCONT

Recovery time of a fault: from the signal to the moment every partition of the
run's topic has committed (in Postgres, with its effects) an offset beyond the
one it had at the signal.  The struck node is started again (or continued) only
after that, so the figure is what the surviving two brokers give; then the run
waits until the node is back in the ISR of every partition of the topic and of
``__consumer_offsets`` (the "back in sync" figure, from the restart) before the
next fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from dedup_dev import helpers
from tests.chaos import driver, report, scenarios
from tests.chaos.services import (
    DEFAULT_DIR,
    SCRIPTS,
    ServicesError,
    _enclosing_owner,
    _run,
    script_env,
)

NODES = 3
PORTS = {
    i: (29109 + 2 * i, 29110 + 2 * i) for i in range(1, NODES + 1)
}  # node -> (broker port, controller port): 29111-29116
CLUSTER_DIR = DEFAULT_DIR.parent / "chaos-cluster"
IN_SYNC_WITHIN = 120.0
TABLE_START = "<!-- chaos-cluster-table:start -->"
TABLE_END = "<!-- chaos-cluster-table:end -->"


def _gone(pid: int) -> bool:
    """The process is dead or a zombie (killed, not yet reaped: its ports are free)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


@dataclass
class KafkaCluster:
    """Where the cluster answers, and the signals that can be sent to its nodes."""

    directory: Path
    bootstrap_servers: str = ""
    owner: bool = False

    @classmethod
    def start(cls, directory: Path) -> KafkaCluster:
        """Start (or join) the cluster under ``directory``; ServicesError with the reason."""
        directory = directory.resolve()
        kafka = directory / "kafka"
        enclosing = _enclosing_owner(directory / "owner")
        if not (kafka / "cluster-id").exists():  # fixed ports, before `up` picks any
            for node, (port, cport) in PORTS.items():
                (kafka / f"node{node}").mkdir(parents=True, exist_ok=True)
                (kafka / f"node{node}" / "port").write_text(f"{port}\n")
                (kafka / f"node{node}" / "controller-port").write_text(f"{cport}\n")
        cluster = cls(directory, owner=enclosing is None)
        if cluster.owner:
            (directory / "owner").write_text(str(os.getpid()))
        cluster._up_sync()
        return cluster

    def _env(self) -> dict[str, str]:
        return {**script_env(self.directory), "DEDUP_KAFKA_BROKERS": str(NODES)}

    def _up_sync(self) -> None:
        _run(
            [SCRIPTS / "up", "kafka"],
            f"DEDUP_KAFKA_BROKERS={NODES} compose/local/up kafka",
            env=self._env(),
        )
        self._load_address()

    def _load_address(self) -> None:
        env = (self.directory / "env").read_text().splitlines()
        found = [line.split("=", 1)[1] for line in env if line.startswith("KAFKA_BOOTSTRAP_")]
        self.bootstrap_servers = found[0] if found else ""
        if self.bootstrap_servers.count(",") != NODES - 1:
            raise ServicesError(f"not {NODES} addresses in {self.directory / 'env'}")

    def stop(self) -> None:
        """Stop the cluster if this session started it."""
        if not self.owner:
            return
        self.resume_all()
        subprocess.run(
            [SCRIPTS / "down", "kafka"], env=self._env(), capture_output=True, check=False
        )
        (self.directory / "owner").unlink(missing_ok=True)

    # -------------------------------------------------------------- nodes --

    def pid(self, node: int) -> int:
        return int((self.directory / "kafka" / f"node{node}" / "pid").read_text().strip())

    def send_signal(self, node: int, sig: signal.Signals) -> None:
        os.kill(self.pid(node), sig)

    def resume_all(self) -> None:
        for node in PORTS:
            with contextlib.suppress(OSError, ValueError):
                self.send_signal(node, signal.SIGCONT)

    async def stop_node(self, node: int, sig: signal.Signals) -> None:
        """Send ``sig`` (SIGKILL or SIGTERM) to ``node``; return once it is gone."""
        pid = self.pid(node)
        os.kill(pid, sig)

        async def gone() -> bool:
            return _gone(pid)

        await helpers.wait_for(gone, within=90, interval=0.05, what=f"kafka node {node} to exit")

    async def start_nodes(self) -> None:
        """Start every node that is down; return once each answers and sees all three."""
        proc = await asyncio.create_subprocess_exec(
            str(SCRIPTS / "up"),
            "kafka",
            env=self._env(),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise ServicesError(f"compose/local/up kafka (cluster) failed:\n{err.decode()}")

    async def heal(self) -> None:
        """Every node running and in sync (after a run that failed halfway)."""
        self.resume_all()
        await self.start_nodes()
        await self.wait_in_sync([])

    # ---------------------------------------------------------- metadata --

    async def _describe(self, topics: list[str]) -> list[dict[str, Any]]:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000
        )
        await admin.start()
        try:
            return list(await admin.describe_topics(topics))
        finally:
            await admin.close()

    async def leaders(self, topic: str) -> dict[int, int]:
        """partition -> the node that leads it."""
        (described,) = await self._describe([topic])
        return {p["partition"]: p["leader"] for p in described["partitions"]}

    async def wait_in_sync(self, topics: list[str]) -> float:
        """Wait until every partition of ``topics`` and of ``__consumer_offsets`` has all
        three replicas in its ISR; the seconds it took."""
        t0 = time.monotonic()

        async def in_sync() -> bool:
            try:
                described = await self._describe([*topics, "__consumer_offsets"])
            except Exception:  # a node still starting, a metadata refresh: ask again
                return False
            return all(
                t["error_code"] in (0, 3)  # 3: __consumer_offsets not made yet
                and all(len(p["isr"]) == NODES for p in t["partitions"])
                for t in described
            )

        await helpers.wait_for(
            in_sync, within=IN_SYNC_WITHIN, interval=0.5, what="every replica back in the ISR"
        )
        return time.monotonic() - t0

    async def active_controller(self) -> int:
        """The node that leads the controller quorum (KRaft's active controller)."""
        proc = await asyncio.create_subprocess_exec(
            str(SCRIPTS / "kafka-tool"),
            "metadata-quorum",
            "--bootstrap-server",
            self.bootstrap_servers,
            "describe",
            "--status",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        found = re.search(r"^LeaderId:\s+(\d+)", out.decode(), re.MULTILINE)
        if proc.returncode != 0 or not found:
            raise ServicesError(f"kafka-metadata-quorum describe --status failed:\n{err.decode()}")
        return int(found.group(1))


# -------------------------------------------------------------- scenarios --


def leader_crash_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    return [
        scenarios.Fault(at, "leader_kill", pick=rng.random(), wait=rng.uniform(0.5, 3.0))
        for at in scenarios._spread(rng, size.faults, 1.5, 3.0)
    ]


def rolling_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    """Every node once per round, in a seeded order."""
    order = [n for _ in range(max(1, size.faults // NODES)) for n in rng.sample(list(PORTS), NODES)]
    return [
        scenarios.Fault(at, "broker_restart", member=node, wait=rng.uniform(0.0, 2.0))
        for at, node in zip(scenarios._spread(rng, len(order), 1.5, 2.0), order, strict=True)
    ]


def controller_crash_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    return [
        scenarios.Fault(at, "controller_kill", wait=rng.uniform(0.5, 3.0))
        for at in scenarios._spread(rng, size.faults, 1.5, 3.0)
    ]


def freeze_schedule(rng: random.Random, size: scenarios.Size) -> list[scenarios.Fault]:
    return [
        scenarios.Fault(at, "broker_pause", pick=rng.random(), wait=rng.uniform(1.0, 4.0))
        for at in scenarios._spread(rng, size.faults, 1.5, 3.0)
    ]


SCENARIOS: dict[str, scenarios.Scenario] = {
    s.name: s
    for s in [
        scenarios.Scenario(
            "leader_crash",
            "SIGKILL the broker leading a consumed partition (three brokers, RF 3, min ISR 2)",
            {
                "short": scenarios.Size(messages=300, faults=1, rate=60),
                "full": scenarios.Size(messages=1200, faults=3, partitions=4, consumers=3, rate=80),
            },
            leader_crash_schedule,
        ),
        scenarios.Scenario(
            "rolling_restart",
            "rolling restart: each broker stopped (SIGTERM) and started, one at a time",
            {"full": scenarios.Size(messages=1200, faults=3, partitions=4, consumers=3, rate=80)},
            rolling_schedule,
        ),
        scenarios.Scenario(
            "controller_crash",
            "SIGKILL the active KRaft controller (a combined broker and controller)",
            {"full": scenarios.Size(messages=1000, faults=2, partitions=4, consumers=3, rate=80)},
            controller_crash_schedule,
        ),
        scenarios.Scenario(
            "broker_freeze",
            "a broker leading a partition SIGSTOPped past its session (fenced), then SIGCONT",
            {"full": scenarios.Size(messages=1000, faults=2, partitions=4, consumers=3, rate=80)},
            freeze_schedule,
        ),
    ]
}


def names() -> list[str]:
    """The cluster scenarios this session's matrix runs (``short``: the leader kill only)."""
    matrix = scenarios.matrix()
    return [name for name, s in SCENARIOS.items() if matrix in s.sizes]


@dataclass
class Result(report.Result):
    """A run's figures, and how long each struck node took to be back in every ISR."""

    in_sync: list[float] = field(default_factory=list)


RESULTS: list[Result] = []


class ClusterRun(driver.ConsumerRun):
    """A consumer run against the cluster, with its faults."""

    replication_factor = NODES

    def __init__(
        self,
        ctx: driver.RunContext,
        cluster: KafkaCluster,
        scenario: scenarios.Scenario,
        seed: int,
        matrix: str,
    ) -> None:
        super().__init__(ctx, scenario, seed, matrix)
        self.cluster = cluster
        self.bootstrap = cluster.bootstrap_servers
        self.result = Result(scenario.name, seed, matrix)

    async def inject_other(self, f: scenarios.Fault) -> None:
        cluster = self.cluster
        if f.kind == "leader_kill":
            partition = min(int(f.pick * self.size.partitions), self.size.partitions - 1)
            node = (await cluster.leaders(self.topic))[partition]
            label = f"SIGKILL of node {node}, leader of partition {partition}"
            sig = signal.SIGKILL
        elif f.kind == "controller_kill":
            node = await cluster.active_controller()
            label = f"SIGKILL of node {node}, the active controller"
            sig = signal.SIGKILL
        elif f.kind == "broker_restart":
            node, label, sig = f.member, f"SIGTERM of node {f.member}", signal.SIGTERM
        elif f.kind == "broker_pause":
            partition = min(int(f.pick * self.size.partitions), self.size.partitions - 1)
            node = (await cluster.leaders(self.topic))[partition]
            label = f"SIGSTOP of node {node}, leader of partition {partition}"
            sig = signal.SIGSTOP
        else:
            await super().inject_other(f)
            return
        affected = await self.offsets_of(None)
        self.watch(label, time.monotonic(), affected)  # from the signal on, shutdown included
        if sig == signal.SIGSTOP:
            cluster.send_signal(node, sig)
        else:
            await cluster.stop_node(node, sig)
        self.note(label)
        if self.recovering is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.recovering), driver.RECOVERY_WITHIN)
        await asyncio.sleep(f.wait)
        t1 = time.monotonic()
        if sig == signal.SIGSTOP:
            cluster.send_signal(node, signal.SIGCONT)
            self.note(f"node {node} continued")
        else:
            await cluster.start_nodes()
            self.note(f"node {node} started again")
        await cluster.wait_in_sync([self.topic])
        took = time.monotonic() - t1
        assert isinstance(self.result, Result)
        self.result.in_sync.append(took)
        self.note(f"node {node} back in every ISR {took:.1f}s after it came back")


async def run(ctx: driver.RunContext, cluster: KafkaCluster, name: str, seed: int) -> Result:
    """Run one cluster scenario with one seed; the result carries the oracle's findings."""
    matrix = scenarios.matrix()
    await cluster.heal()
    the_run = ClusterRun(ctx, cluster, SCENARIOS[name], seed, matrix)
    result = await driver.conclude(the_run, matrix)
    assert isinstance(result, Result)
    return result


# ------------------------------------------------------------------ table --


def table(results: list[report.Result]) -> str:
    """One Markdown row per cluster scenario, summed over its runs (seeds)."""
    by: dict[str, list[Result]] = {}
    for r in results:
        assert isinstance(r, Result)
        by.setdefault(r.scenario, []).append(r)
    rows = [
        "| scenario | runs (seeds) | messages | faults | lost | doubled "
        "| stale writes committed | duplicates suppressed | recovery, median | recovery, worst "
        "| back in sync, worst |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def seconds(values: list[float], pick: Any) -> str:
        return f"{pick(values):.1f} s" if values else "-"

    for name, runs in by.items():
        recoveries = [x for r in runs for x in r.recoveries]
        in_sync = [x for r in runs for x in r.in_sync]
        rows.append(
            f"| {name} | {len(runs)} ({', '.join(str(r.seed) for r in runs)})"
            f" | {sum(r.messages for r in runs)} | {sum(r.faults for r in runs)}"
            f" | {sum(r.lost for r in runs)} | {sum(r.doubled for r in runs)}"
            f" | {sum(r.stale_committed for r in runs)} | {sum(r.duplicates for r in runs)}"
            f" | {seconds(recoveries, statistics.median)} | {seconds(recoveries, max)}"
            f" | {seconds(in_sync, max)} |"
        )
    return "\n".join(rows)


def summary(terminalreporter: Any) -> None:
    """The cluster runs' table: on the terminal, next to the chaos report, in the docs."""
    report.summarize(
        terminalreporter,
        list(RESULTS),
        title="three-broker Kafka",
        suffix="kafka-cluster",
        render=table,
        start=TABLE_START,
        end=TABLE_END,
    )
