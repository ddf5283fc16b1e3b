"""Kafka faults on a three-broker cluster (:mod:`tests.chaos.kafka_cluster`), checked by the oracle.

``make test`` runs one leader kill; ``make chaos`` every cluster scenario with
several seeds.  Each fault's recovery time goes to the cluster table of
docs/reliability.md.  ``compose/local/status`` names the cluster's nodes.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.chaos import driver, kafka_cluster, scenarios
from tests.chaos.services import SCRIPTS, script_env

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("seed", scenarios.seeds(), ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("scenario", kafka_cluster.names())
async def test_cluster(
    scenario: str,
    seed: int,
    chaos_run: driver.RunContext,
    chaos_kafka_cluster: kafka_cluster.KafkaCluster,
) -> None:
    result = await kafka_cluster.run(chaos_run, chaos_kafka_cluster, scenario, seed)
    kafka_cluster.RESULTS.append(result)
    print(result.line())
    rerun = (
        f"CHAOS_SEED={seed} CHAOS_MATRIX={result.matrix} "
        f".venv/bin/pytest tests/chaos/test_cluster.py -k {scenario}"
    )
    assert not result.violations, "\n".join([result.line(), *result.violations, f"rerun: {rerun}"])
    assert (result.lost, result.doubled, result.stale_committed) == (0, 0, 0)
    assert result.faults >= 1, "no fault was injected"
    assert len(result.recoveries) == result.faults, "a fault without its recovery time"


def test_status_names_every_node(chaos_kafka_cluster: kafka_cluster.KafkaCluster) -> None:
    run = subprocess.run(
        [SCRIPTS / "status", "kafka"],
        env=script_env(chaos_kafka_cluster.directory),
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    nodes = [line.split() for line in run.stdout.splitlines() if line.startswith("kafka ")]
    addresses = [f"127.0.0.1:{port}" for port, _ in kafka_cluster.PORTS.values()]
    assert [(n[1], n[2], n[3]) for n in nodes] == [
        ("running", address, f"node{i}") for i, address in enumerate(addresses, 1)
    ], run.stdout
    assert f"KAFKA_BOOTSTRAP_SERVERS={','.join(addresses)}" in run.stdout
