"""What a partition's row says after a refused fence: landed, moved, forgotten or taken."""

from __future__ import annotations

import pytest

from dedup import _store as store
from dedup.consumer import _refusal as refusal
from dedup.operations import _offsets as offsets

ME, OTHER = "c1", "c2"
OPERATOR = offsets.OPERATOR_PREFIX + "alice"


@pytest.mark.parametrize(
    ("row", "token", "expected", "verdict"),
    [
        # our commit in doubt had landed: our token, further on
        (store.Position(ME, 5, 30), 5, 20, refusal.LANDED),
        (store.Position(ME, 5, 30), 5, None, refusal.LANDED),
        # an operator moved it: a newer token, their holder
        (store.Position(OPERATOR, 6, 3), 5, 20, refusal.MOVED),
        # another consumer took it
        (store.Position(OTHER, 6, 25), 5, 20, refusal.TAKEN),
        (store.Position(ME, 5, 20), 5, 20, refusal.TAKEN),
        # Postgres lost our last commits: our token further back, an older token, no row
        (store.Position(ME, 5, 12), 5, 20, refusal.FORGOTTEN),
        (store.Position(ME, 5, None), 5, 20, refusal.FORGOTTEN),
        (store.Position(OTHER, 4, 12), 5, 20, refusal.FORGOTTEN),
        (None, 5, 20, refusal.FORGOTTEN),
    ],
)
def test_judge(row: store.Position | None, token: int, expected: int | None, verdict: str) -> None:
    assert refusal.judge(row, token, expected) == verdict
