"""Network partitions (:mod:`tests.chaos.netsplit`), each run checked by the oracle.

``make test`` runs one short Postgres cut; ``make chaos`` every partition
scenario with several seeds.  The figures of each fault (cut → takeover,
heal → progress) go to the partition table of docs/reliability.md.
"""

from __future__ import annotations

import pytest

from tests.chaos import driver, netsplit, scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("seed", scenarios.seeds(), ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("scenario", netsplit.names())
async def test_partition(scenario: str, seed: int, chaos_run: driver.RunContext) -> None:
    result = await netsplit.run(chaos_run, scenario, seed)
    netsplit.RESULTS.append(result)
    print(result.line())
    rerun = (
        f"CHAOS_SEED={seed} CHAOS_MATRIX={result.matrix} "
        f".venv/bin/pytest tests/chaos/test_partitions.py -k {scenario}"
    )
    assert not result.violations, "\n".join([result.line(), *result.violations, f"rerun: {rerun}"])
    assert (result.lost, result.doubled, result.stale_committed) == (0, 0, 0)
    assert result.faults >= 1, "no fault was injected"
    assert len(result.progress) == result.faults, "a fault without its heal → progress time"
