"""Every fault class of the failure model (docs/reliability.md), each run checked by the oracle.

``make test`` runs one seed of each scenario with small counts; ``make chaos``
runs the full matrix (``CHAOS_MATRIX=full``).  A failing run prints its story
(schedule, faults, recoveries) and the command that replays its seed.
"""

from __future__ import annotations

import pytest

from tests.chaos import driver, report, scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("seed", scenarios.seeds(), ids=lambda s: f"seed{s}")
@pytest.mark.parametrize(
    "scenario", [n for n, s in scenarios.SCENARIOS.items() if scenarios.matrix() in s.sizes]
)
async def test_chaos(scenario: str, seed: int, chaos_run: driver.RunContext) -> None:
    result = await driver.run(chaos_run, scenario, seed)
    report.RESULTS.append(result)
    print(result.line())
    rerun = (
        f"CHAOS_SEED={seed} CHAOS_MATRIX={result.matrix} .venv/bin/pytest tests/chaos -k {scenario}"
    )
    assert not result.violations, "\n".join([result.line(), *result.violations, f"rerun: {rerun}"])
    assert (result.lost, result.doubled, result.stale_committed) == (0, 0, 0)
    assert result.faults >= 1, "no fault was injected"
