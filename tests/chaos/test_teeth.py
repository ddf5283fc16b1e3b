"""The oracle has teeth: deliberately broken consumers make their scenarios fail.

Each test runs a scenario's tiny size against a consumer broken on purpose in
its child process (``CHAOS_BREAK``, see :mod:`tests.chaos.consumer_child`) and
asserts that the oracle reports the damage the break must cause.  If these
pass with a working consumer's figures, the oracle checks nothing.
"""

from __future__ import annotations

import pytest

from tests.chaos import driver

pytestmark = pytest.mark.chaos


async def test_storing_the_offset_before_the_commit_loses_messages(
    chaos_run: driver.RunContext,
) -> None:
    # Seed 2 of the kill scenario's tiny size kills before the commit: the offset
    # was already stored, the batch's writes die with the process.
    result = await driver.run(chaos_run, "kill", 2, matrix="tiny", broken="offset_first")
    print(result.line())
    assert [f for f in result.violations if "did not complete" in f] == []
    assert result.lost > 0, result.violations
    assert any("stored offset ahead of unapplied records" in v for v in result.violations)


async def test_without_the_fence_a_paused_owner_commits_under_a_stale_token(
    chaos_run: driver.RunContext,
) -> None:
    # Seed 1 of the pause scenario's tiny size pauses a member with a turn's records
    # taken, before its BEGIN; after SIGCONT the turn goes on and, with no fence,
    # commits under its old token.
    result = await driver.run(chaos_run, "pause", 1, matrix="tiny", broken="no_fence")
    print(result.line())
    assert [f for f in result.violations if "did not complete" in f] == []
    assert result.stale_committed > 0, result.violations
    assert result.stale_refused == 0


async def test_a_write_outside_the_transaction_is_applied_twice(
    chaos_run: driver.RunContext,
) -> None:
    # The kill before the commit rolls the key claim back, but the handler's write
    # went through its own connection and stays: the redelivered batch applies again.
    result = await driver.run(chaos_run, "kill", 3, matrix="tiny", broken="outside_tx")
    print(result.line())
    assert [f for f in result.violations if "did not complete" in f] == []
    assert result.doubled > 0, result.violations


async def test_offsets_in_kafka_lose_what_a_failover_lost(chaos_run: driver.RunContext) -> None:
    # The failover loses the commits made while replication was held up; Postgres'
    # offsets go back with them, but this consumer goes on from its own position
    # (as from offsets committed to Kafka): their records are never applied again.
    result = await driver.run(chaos_run, "failover", 1, matrix="tiny", broken="kafka_offsets")
    print(result.line())
    assert [f for f in result.violations if "did not complete" in f] == []
    assert result.lost_commits
    assert result.lost > 0, result.violations
