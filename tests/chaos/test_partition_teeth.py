"""The partition scenarios have teeth: consumers broken on purpose make them fail.

Each test runs a partition scenario's tiny size (one fault) against a consumer
broken in its child process (``CHAOS_BREAK``, :mod:`tests.chaos.consumer_child`)
and asserts that the oracle reports the damage the break must cause.  Part of
``make chaos`` only (``CHAOS_MATRIX=full``): ``make test`` runs one partition run.
"""

from __future__ import annotations

import pytest

from tests.chaos import driver, netsplit

pytestmark = pytest.mark.chaos


def completed(result: netsplit.Result) -> None:
    print(result.line())
    assert [v for v in result.violations if "did not complete" in v] == []


async def test_without_the_fence_a_commit_whose_answer_was_lost_is_claimed_again(
    chaos_run: driver.RunContext,
) -> None:
    # pg_cut's tiny size is one pg_reset_after_commit: the batch's COMMIT lands, its
    # answer is lost with the connection.  The fence would tell the batch landed; without
    # it the batch runs again and claims its own keys a second time.
    result = await netsplit.run(chaos_run, "pg_cut", 1, matrix="tiny", broken="no_fence")
    completed(result)
    assert any("not each counted once" in v for v in result.violations), result.violations


async def test_without_the_fence_a_member_cut_off_from_kafka_commits_under_a_stale_token(
    chaos_run: driver.RunContext,
) -> None:
    # kafka_cut's tiny size is one kafka_cut_before_begin: a turn taken before the cut
    # goes on once another member owns the partition.  The fence would refuse it.
    result = await netsplit.run(chaos_run, "kafka_cut", 1, matrix="tiny", broken="no_fence")
    completed(result)
    assert result.stale_committed > 0, result.violations
    assert result.stale_refused == 0


async def test_without_the_idle_timeout_a_cut_member_holds_its_partitions_until_the_heal(
    chaos_run: driver.RunContext,
) -> None:
    # both_cut's tiny size is one both_cut_before_commit: the member's transaction holds
    # its partition's row.  The server would end the session after its idle timeout;
    # without one, the takeover waits for the network to heal.
    result = await netsplit.run(chaos_run, "both_cut", 1, matrix="tiny", broken="no_idle_timeout")
    completed(result)
    assert any("not taken over" in v for v in result.violations), result.violations


async def test_an_unfenced_job_cut_off_past_its_lease_commits_its_write_late(
    chaos_run: driver.RunContext,
) -> None:
    # task_cut's tiny size is one task_cut_writing: the runner's write and its COMMIT are
    # held by the cut while another runner takes over and finishes.  Seed 5 heals 0.5 s
    # after the takeover, inside the server's idle timeout: the queued COMMIT arrives.
    # Fenced, it would be refused; the unfenced job's write lands, a second effect under
    # a token that no longer held the lease.
    result = await netsplit.run(chaos_run, "task_cut", 5, matrix="tiny", broken="no_fence")
    completed(result)
    assert result.stale_committed > 0, result.violations
    assert result.doubled > 0, result.violations


async def test_without_the_fence_a_flapping_link_claims_commits_whose_answer_it_lost(
    chaos_run: driver.RunContext,
) -> None:
    # Some of the flap's cuts fall right behind a COMMIT and end in a reset: the COMMIT
    # landed, the consumer never heard.  The fence would tell; without it the batch runs
    # again and its keys are claimed twice.
    result = await netsplit.run(chaos_run, "flap", 1, matrix="tiny", broken="no_fence")
    completed(result)
    assert any("not each counted once" in v for v in result.violations), result.violations
