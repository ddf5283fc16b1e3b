"""The table-size benchmark's pure parts: its keys, its verdicts, its section."""

from __future__ import annotations

from typing import Any

import orjson

from bench import table_size


def _round(rate: float, ok: bool = True) -> dict[str, Any]:
    return {"ok": ok, "msgs_per_s": rate, "claim_ms": 30.0, "index_reads_per_key": 0.5}


def test_random_keys_rename_every_copy_of_a_key_alike() -> None:
    records = [
        (b"pay-07-0000000001", orjson.dumps({"id": "pay-07-0000000001", "amount": 5})),
        (b"pay-07-0000000002", orjson.dumps({"id": "pay-07-0000000002", "amount": 6})),
        (b"pay-07-0000000001", orjson.dumps({"id": "pay-07-0000000001", "amount": 5})),
    ]
    renamed = table_size.random_keys(records, seed=1)
    keys = [key for key, _ in renamed]
    assert keys[0] == keys[2] != keys[1]
    assert all(key.startswith(b"order-") and len(key) == 42 for key in keys)
    assert [orjson.loads(value)["id"].encode() for _, value in renamed] == keys
    assert orjson.loads(renamed[1][1])["amount"] == 6
    assert table_size.random_keys(records, seed=1) == renamed


def test_verdicts_come_from_the_paired_ratios_not_from_medians_taken_apart() -> None:
    # The machine slows down in round 2: both tables halve, the ratio does not move.
    pairs = [
        {"sized": _round(800.0), "empty": _round(1000.0), "ratio": 0.8},
        {"sized": _round(400.0), "empty": _round(500.0), "ratio": 0.8},
        {"sized": _round(390.0), "empty": _round(600.0), "ratio": 0.65},
    ]
    size = {
        "keys": 50_000_000,
        "fill": {"total_s": 600.0},
        "heap_bytes": 2**33,
        "index_bytes": 2**32,
        "shared_buffers_bytes": 2**28,
        "pairs": pairs,
    }
    slice_ = {"during": _round(700.0), "after": _round(1000.0), "ratio": 0.7}
    purge = {
        "keys": 10_000_000,
        "seconds": 200.0,
        "keys_per_s": 50_000,
        "batches": 2000,
        "batches_skipped": 0,
        "slices": [slice_],
    }
    summary = table_size.summarize([size], purge)
    assert summary["sizes"][0]["ratio"] == {"median": 0.8, "min": 0.65, "max": 0.8}
    assert [(t["value"], t["passed"]) for t in summary["targets"]] == [(0.8, True), (0.7, False)]
    summary["config"] = {"messages": 100_000, "rounds": 3, "command": "x", "wall_s": 1200}
    page = table_size.markdown(summary)
    assert "| 50,000,000 | 600 | 8,192 MiB | 4,096 MiB | 400 | 600 | 0.80 (0.65-0.80) |" in page
    assert "`shared_buffers`: 256 MiB" in page
    assert "| dedup_batch during purge / right after it >= 0.8 | 0.70 | FAIL |" in page
    assert "10,000,000 expired keys" in page
    assert "(50,000 keys/s" in page
