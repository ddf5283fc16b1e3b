"""Idempotency key strategies: pure functions of a message."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dedup
from dedup import keys


def msg(value: bytes = b"{}", key: bytes | None = None, **headers: bytes) -> dedup.Message:
    return dedup.Message("orders", 3, 42, key, value, dict(headers), 0)


def test_json_field_joins_dotted_paths() -> None:
    value = orjson.dumps({"task": "close", "date": "2026-11-30", "doc": {"number": 17}})
    assert keys.json_field("task", "date", "doc.number")(msg(value)) == "close:2026-11-30:17"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{oops", "invalid JSON"),
        (b'{"a": 1}', "missing key field 'id'"),
        (b'{"id": null}', "key field 'id' is null"),
        (b'{"id": {"x": 1}}', "not a string or number"),
        (b"[1, 2]", "missing key field 'id'"),
    ],
)
def test_json_field_says_why_there_is_no_key(value: bytes, reason: str) -> None:
    with pytest.raises(dedup.KeyExtractionError, match=reason):
        keys.extract(keys.json_field("id"), msg(value))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)


@given(doc=st.dictionaries(st.sampled_from(["id", "x"]), json_values) | json_values)
def test_one_top_level_field_gives_what_the_dotted_path_lookup_gives(doc: object) -> None:
    # json_field("id") has a fast path; json_field("id", "id") takes the general one.
    value = orjson.dumps(doc)

    def outcome(strategy: keys.Strategy) -> str:
        try:
            return keys.extract(strategy, msg(value))
        except dedup.KeyExtractionError as exc:
            return f"error: {exc}"

    fast, general = outcome(keys.json_field("id")), outcome(keys.json_field("id", "id"))
    if general.startswith("error: "):
        assert fast == general
    else:
        assert f"{fast}:{fast}" == general


def test_header_kafka_key_and_offset() -> None:
    m = msg(key=b"k-1", **{"idempotency-key": b"abc"})
    assert keys.header("idempotency-key")(m) == "abc"
    assert keys.kafka_key()(m) == "k-1"
    assert keys.offset()(m) == "orders:3:42"
    with pytest.raises(dedup.KeyExtractionError, match="missing header 'other'"):
        keys.header("other")(m)
    with pytest.raises(dedup.KeyExtractionError, match="not UTF-8"):
        keys.kafka_key()(msg(key=b"\xff\xfe"))


def test_first_takes_the_first_strategy_that_gives_a_key() -> None:
    strategy = keys.first(keys.header("idempotency-key"), keys.json_field("id"), keys.offset())
    assert strategy(msg(b'{"id": 7}')) == "7"
    assert strategy(msg(b"{}")) == "orders:3:42"
    only_missing = keys.first(keys.header("h"), keys.kafka_key())
    with pytest.raises(dedup.KeyExtractionError, match="missing header 'h'; the record has no"):
        only_missing(msg())


def test_any_callable_is_a_strategy_and_its_failures_are_reasons() -> None:
    assert keys.extract(lambda m: f"custom-{m.offset}", msg()) == "custom-42"
    with pytest.raises(dedup.KeyExtractionError, match="gave no key"):
        keys.extract(lambda m: None, msg())
    with pytest.raises(dedup.KeyExtractionError, match="failed: ZeroDivisionError"):
        keys.extract(lambda m: str(1 / 0), msg())


@given(st.text(min_size=1).filter(lambda s: "\x00" not in s))
def test_any_text_id_round_trips_through_json_field(ident: str) -> None:
    assert keys.extract(keys.json_field("id"), msg(orjson.dumps({"id": ident}))) == ident


def test_message_json_is_decoded_once() -> None:
    m = msg(b'{"a": 1}')
    assert m.json() is m.json()
