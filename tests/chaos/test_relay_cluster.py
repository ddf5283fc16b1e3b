"""The outbox pipeline of test_relay.py on the three-broker cluster: the output's leader killed.

Exactly once, on topics of three replicas with ``min.insync.replicas=2``: a
relay SIGKILLed between the broker and its mark, the broker leading the output
topic's partition 0 SIGKILLed (started again once the relay published without
it), a zombie relay; the same oracle.  ``make chaos`` only (the full matrix):
the cluster is three more JVMs.
"""

from __future__ import annotations

import pytest

from tests.chaos import driver, kafka_cluster
from tests.chaos import test_relay as relay

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("seed", relay.SEEDS["full"], ids=lambda s: f"seed{s}")
async def test_relay_on_three_brokers_survives_losing_the_output_leader(
    seed: int, chaos_run: driver.RunContext, chaos_kafka_cluster: kafka_cluster.KafkaCluster
) -> None:
    faults = ["kill_after_send", "kill_output_leader", "pause_before_send"]
    await relay.pipeline(
        relay.Pipeline(chaos_run, "exactly_once", seed, chaos_kafka_cluster), faults
    )
