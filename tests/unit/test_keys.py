"""Idempotency key strategies and the key format: pure functions of a message.

The golden tables pin the stored format (docs/concepts/guarantees.md, "Key
format").  A change that breaks one of them changes the key of messages users
have already stored, so those messages would be applied again: don't edit an
expected value to make a test pass.
"""

from __future__ import annotations

import dataclasses
import decimal
import itertools
import json
from typing import Any

import orjson
import pytest
from aiokafka.structs import ConsumerRecord
from hypothesis import given
from hypothesis import strategies as st

import dedup
from dedup import keys


def msg(value: bytes = b"{}", key: bytes | None = None, **headers: bytes) -> dedup.Message:
    return dedup.Message("orders", 3, 42, key, value, dict(headers), 0)


def stored_key(strategy: keys.Strategy, value: bytes) -> str:
    return keys.extract(strategy, msg(value))


LONG_X = "x" * 257
LONG_X_DIGEST = "sha256:15eb95a462ee20bd91a415ae2d4aed341288186ddaa2b37908f7d592f0c3f85f"

# (JSON value of the message, stored key of json_field("id")), written out by hand.
ONE_FIELD = [
    # strings are themselves
    (b'{"id": "pay-1"}', "pay-1"),
    (b'{"id": "42"}', "42"),
    (b'{"id": " pay-1 "}', " pay-1 "),
    ('{"id": "café-☕-支付"}'.encode(), "café-☕-支付"),
    (b'{"id": "\\u00e9"}', "é"),
    (b'{"id": "a:b\\\\c"}', "a:b\\c"),  # one field: nothing to escape
    (b'{"id": "-7"}', "-7"),
    # ... except that a leading # is doubled, so no string looks like a number
    (b'{"id": "#42"}', "##42"),
    (b'{"id": "#"}', "##"),
    (b'{"id": "##x"}', "###x"),
    (b'{"id": "a#"}', "a#"),
    # numbers are # and their exact value in plain decimal
    (b'{"id": 42}', "#42"),
    (b'{"id": -7}', "#-7"),
    (b'{"id": 0}', "#0"),
    (b'{"id": -0}', "#0"),
    (b'{"id": 0.0}', "#0"),
    (b'{"id": -0.0e5}', "#0"),
    (b'{"id": 1.0}', "#1"),
    (b'{"id": 1e2}', "#100"),
    (b'{"id": 1E+2}', "#100"),
    (b'{"id": 100}', "#100"),
    (b'{"id": 1.50}', "#1.5"),
    (b'{"id": 0.1}', "#0.1"),
    (b'{"id": 0.001}', "#0.001"),
    (b'{"id": 1e-7}', "#0.0000001"),
    (b'{"id": -1.5e3}', "#-1500"),
    (b'{"id": 123.456}', "#123.456"),
    (b'{"id": 9007199254740993}', "#9007199254740993"),  # 2**53 + 1
    (b'{"id": 9007199254740993.0}', "#9007199254740993"),  # a double would say ...992
    (b'{"id": 18446744073709551615}', "#18446744073709551615"),  # 2**64 - 1
    (b'{"id": 18446744073709551616}', "#18446744073709551616"),
    (b'{"id": -9223372036854775809}', "#-9223372036854775809"),
    (b'{"id": 123456789012345678901234567890}', "#123456789012345678901234567890"),
    (b'{"id": 123456789012345678901234567891}', "#123456789012345678901234567891"),
    (b'{"id": -123456789012345678901234567890}', "#-123456789012345678901234567890"),
    # the stored form: long keys, digest look-alikes and NULs become digests
    (b'{"id": "' + b"x" * 256 + b'"}', "x" * 256),
    (b'{"id": "' + LONG_X.encode() + b'"}', LONG_X_DIGEST),
    (
        ('{"id": "' + "é" * 128 + '"}').encode(),  # 256 bytes
        "é" * 128,
    ),
    (
        ('{"id": "' + "é" * 129 + '"}').encode(),  # 258 bytes in 129 characters
        "sha256:a62bf20794e9afb2766a5305affe539386952b597ef3107ff06b810cf3edc29d",
    ),
    (
        b'{"id": "sha256:abc"}',
        "sha256:67e9bc3cfd2163c2978358dfe00d2f912cd4ee0c99f077c3583b39b48aebb124",
    ),
    (
        b'{"id": "a\\u0000b"}',
        "sha256:59b271ae1bbcb1d31d41929817f4b16fb439eb4f31520b5ad1d5ce98920a7138",
    ),
    (
        b'{"id": 1' + b"1" * 299 + b"}",  # "#1...1" is 301 bytes: digest of that text
        "sha256:bf2141c041cbfb68d118fa338b32cfeda51ee81334a3543d85d8f3c9e0a35477",
    ),
]

# (JSON value, stored key of json_field("a", "b")).
TWO_FIELDS = [
    (b'{"a": "x", "b": "y"}', "x:y"),
    (b'{"a": "x:y", "b": "z"}', "x\\:y:z"),
    (b'{"a": "x", "b": "y:z"}', "x:y\\:z"),
    (b'{"a": "x\\\\", "b": "y"}', "x\\\\:y"),
    (b'{"a": "x", "b": "\\\\:y"}', "x:\\\\\\:y"),
    (b'{"a": 42, "b": "42"}', "#42:42"),
    (b'{"a": "#42", "b": 1.0}', "##42:#1"),
    (b'{"a": "", "b": ""}', ":"),
    (b'{"a": -1.5, "b": 18446744073709551616}', "#-1.5:#18446744073709551616"),
    ('{"a": "ü:é", "b": "☕"}'.encode(), "ü\\:é:☕"),
]


@pytest.mark.parametrize(("value", "key"), ONE_FIELD)
def test_golden_keys_of_one_field(value: bytes, key: str) -> None:
    assert stored_key(keys.json_field("id"), value) == key
    # A dotted path of one field takes the general path: the same key.
    wrapped = b'{"doc": ' + value + b"}"
    assert stored_key(keys.json_field("doc.id"), wrapped) == key


@pytest.mark.parametrize(("value", "key"), TWO_FIELDS)
def test_golden_keys_of_two_fields(value: bytes, key: str) -> None:
    assert stored_key(keys.json_field("a", "b"), value) == key


def test_golden_key_of_three_dotted_paths() -> None:
    value = orjson.dumps({"task": "close", "date": "2026-11-30", "doc": {"number": 17}})
    assert stored_key(keys.json_field("task", "date", "doc.number"), value) == (
        "close:2026-11-30:#17"
    )


def test_golden_keys_of_the_other_strategies() -> None:
    m = msg(key="k-1:é".encode(), **{"idempotency-key": b"#abc"})
    assert keys.extract(keys.header("idempotency-key"), m) == "#abc"  # as it came
    assert keys.extract(keys.kafka_key(), m) == "k-1:é"
    assert keys.extract(keys.offset(), m) == "orders:3:42"
    assert keys.extract(keys.kafka_key(), msg(key=LONG_X.encode())) == LONG_X_DIGEST


@pytest.mark.parametrize(
    ("key", "as_stored"),
    [
        ("pay-1", "pay-1"),
        ("x" * 256, "x" * 256),
        (LONG_X, LONG_X_DIGEST),
        ("sha256:", "sha256:9fd714ce6f63c3b320c944b70e80a5d105fd2f3e2d30ae2fa81370e223f50d07"),
        ("sha256", "sha256"),
        ("SHA256:abc", "SHA256:abc"),
        ("\ud800", "sha256:91a681b998555fb475479817b126c94e57e52011fa1842c5d188795a4a05226b"),
    ],
)
def test_golden_stored_forms(key: str, as_stored: str) -> None:
    assert keys.stored(key) == as_stored
    assert keys.extract(lambda m: key, msg()) == as_stored


def test_lookup_forms_find_a_key_as_known_and_as_stored() -> None:
    assert keys.lookup_forms("pay-1") == ["pay-1"]
    assert keys.lookup_forms(LONG_X) == [LONG_X_DIGEST, LONG_X]
    # A digest copied from a listing finds the row it names (and the key it is itself).
    assert keys.lookup_forms(LONG_X_DIGEST) == [keys.stored(LONG_X_DIGEST), LONG_X_DIGEST]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{oops", "invalid JSON"),
        (b'{"a": 1}', "missing key field 'id'"),
        (b'{"id": null}', "key field 'id' is null"),
        (b'{"id": {"x": 1}}', "key field 'id' is a object, not a string or number"),
        (b'{"id": [1]}', "key field 'id' is a array, not a string or number"),
        (b'{"id": true}', "key field 'id' is a boolean, not a string or number"),
        (b'{"id": ""}', "gave no key"),
        (b"[1, 2]", "missing key field 'id'"),
        (b'{"id": 1e-5000}', "number of more than 4300 digits: send such an id as a JSON string"),
        (b'{"id": -1e-999999999}', "number of more than 4300 digits"),
    ],
)
def test_json_field_says_why_there_is_no_key(value: bytes, reason: str) -> None:
    with pytest.raises(dedup.KeyExtractionError, match=reason.replace("(", r"\(")):
        keys.extract(keys.json_field("id"), msg(value))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)


def outcome(strategy: keys.Strategy, value: bytes) -> str:
    try:
        return keys.extract(strategy, msg(value))
    except dedup.KeyExtractionError as exc:
        return f"error: {exc}"


def escaped(part: str) -> str:
    return part.replace("\\", "\\\\").replace(":", "\\:")


@given(doc=st.dictionaries(st.sampled_from(["id", "x"]), json_values) | json_values)
def test_one_top_level_field_gives_what_the_general_path_gives(doc: object) -> None:
    # json_field("id") has a fast path; json_field("id", "id") takes the general one.
    value = json.dumps(doc).encode()  # integers past 64 bits too

    def as_given(strategy: keys.Strategy) -> str | None:
        try:
            return strategy(msg(value))
        except dedup.KeyExtractionError as exc:
            return f"error: {exc}"

    fast, general = as_given(keys.json_field("id")), as_given(keys.json_field("id", "id"))
    assert fast is not None
    if fast.startswith("error: "):
        assert fast == general
    else:
        assert general == f"{escaped(fast)}:{escaped(fast)}"


# Key material: strings heavy in the format's special characters, and numbers
# written every way JSON allows (integers of any size, fractions, exponents).
texts = st.text(alphabet=st.sampled_from("ab#:\\é☕s"), max_size=6) | st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=4
)
numbers = (
    st.integers(-(10**40), 10**40).map(lambda n: (decimal.Decimal(n), str(n).encode()))
    | st.decimals(allow_nan=False, allow_infinity=False, places=None)
    .filter(lambda d: abs(d.adjusted()) < 200)
    .map(lambda d: (d, str(d).encode()))
    | st.floats(allow_nan=False, allow_infinity=False).map(
        lambda f: (decimal.Decimal(orjson.dumps(f).decode()), orjson.dumps(f))
    )
)
scalars = texts.map(lambda s: (s, orjson.dumps(s))) | numbers


def meaning(value: object) -> tuple[str, object]:
    """What a key stands for: a string by its text, a number by its value (1.0 is 1)."""
    if isinstance(value, str):
        return ("string", value)
    assert isinstance(value, decimal.Decimal)
    return ("number", value.normalize(decimal.Context(prec=1000)))


def read_part(part: str) -> tuple[str, object]:
    """The value one field's key (before any digest) was made from: the format, decoded."""
    if part.startswith("#") and not part.startswith("##"):
        return ("number", decimal.Decimal(part[1:]))
    return ("string", part[1:] if part.startswith("#") else part)


def read_back(key: str) -> list[tuple[str, object]]:
    """The values a key of several fields was made from."""
    parts, part, chars = [], "", iter(key)
    for char in chars:
        if char == "\\":
            part += next(chars)
        elif char == ":":
            parts.append(part)
            part = ""
        else:
            part += char
    parts.append(part)
    return [read_part(p) for p in parts]


@given(st.lists(scalars, min_size=2, max_size=8))
def test_one_field_keys_are_equal_exactly_when_the_values_are(
    found: list[tuple[Any, bytes]],
) -> None:
    strategy = keys.json_field("id")
    made = []
    for value, text in found:
        doc = b'{"id": ' + text + b"}"
        if meaning(value) == ("string", ""):
            continue  # an empty string is no key
        as_given = strategy(msg(doc))
        assert as_given is not None
        if len(as_given) < 200:  # longer numbers are hashed: see the golden tables
            assert meaning(read_part(as_given)[1]) == meaning(value)
        made.append((meaning(value), keys.extract(strategy, msg(doc))))
    for (a, key_a), (b, key_b) in itertools.combinations(made, 2):
        assert (key_a == key_b) == (a == b), (a, key_a, b, key_b)


@given(st.lists(st.tuples(scalars, scalars), min_size=2, max_size=8))
def test_two_field_keys_are_equal_exactly_when_both_values_are(
    found: list[tuple[tuple[Any, bytes], tuple[Any, bytes]]],
) -> None:
    strategy = keys.json_field("a", "b")
    made = []
    for (a, text_a), (b, text_b) in found:
        doc = b'{"a": ' + text_a + b', "b": ' + text_b + b"}"
        as_given = strategy(msg(doc))
        assert as_given is not None
        if len(as_given) < 200:
            assert [meaning(v) for _, v in read_back(as_given)] == [meaning(a), meaning(b)]
        made.append(((meaning(a), meaning(b)), keys.extract(strategy, msg(doc))))
    for (a, key_a), (b, key_b) in itertools.combinations(made, 2):
        assert (key_a == key_b) == (a == b), (a, key_a, b, key_b)


@given(
    st.text(alphabet=st.sampled_from("ab:\\#"), max_size=4),
    st.text(alphabet=st.sampled_from("ab:\\#"), max_size=4),
    st.text(alphabet=st.sampled_from("ab:\\#"), max_size=4),
)
def test_a_separator_inside_a_part_never_moves_the_boundary(a: str, b: str, c: str) -> None:
    strategy = keys.json_field("a", "b")

    def key(first: str, second: str) -> str:
        return keys.extract(strategy, msg(orjson.dumps({"a": first, "b": second})))

    assert key(f"{a}:{b}", c) != key(a, f"{b}:{c}")
    assert key(f"{a}\\", c) != key(a, f"\\{c}")


keys_as_given = (
    st.text(alphabet=st.sampled_from("sha256:x\x00é"), max_size=10)
    | st.text(max_size=300)
    | st.text(alphabet="xé", min_size=60, max_size=300)
    | st.text(max_size=64).map(lambda s: "sha256:" + s)
)


@given(
    st.lists(keys_as_given, min_size=1, max_size=6).map(
        # each key along with its own digest as a key: the prefix rule keeps them apart
        lambda found: sorted(set(found) | {keys.stored(k) for k in found})
    )
)
def test_distinct_keys_have_distinct_stored_forms_that_postgres_can_index(
    given_keys: list[str],
) -> None:
    as_stored = [keys.stored(k) for k in given_keys]
    assert len(set(as_stored)) == len(given_keys)
    for key in as_stored:
        assert len(key.encode("utf-8")) <= keys.MAX_KEY_BYTES
        assert "\x00" not in key


def test_header_kafka_key_and_offset_say_why_there_is_no_key() -> None:
    m = msg(key=b"k-1", **{"idempotency-key": b"abc"})
    assert keys.header("idempotency-key")(m) == "abc"
    with pytest.raises(dedup.KeyExtractionError, match="missing header 'other'"):
        keys.header("other")(m)
    with pytest.raises(dedup.KeyExtractionError, match="not UTF-8"):
        keys.kafka_key()(msg(key=b"\xff\xfe"))
    with pytest.raises(dedup.KeyExtractionError, match="the record has no Kafka key"):
        keys.kafka_key()(msg())


def test_first_takes_the_first_strategy_that_gives_a_key() -> None:
    strategy = keys.first(keys.header("idempotency-key"), keys.json_field("id"), keys.offset())
    assert strategy(msg(b'{"id": 7}')) == "#7"
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
    with pytest.raises(dedup.KeyExtractionError, match="gave a int, not a str"):
        keys.extract(lambda m: 42, msg())  # type: ignore[arg-type,return-value]


def test_a_reason_never_carries_a_huge_key() -> None:
    huge = "k" * 1_000_000

    def fails(m: dedup.Message) -> str:
        raise ValueError(f"bad key {huge}")

    def refuses(m: dedup.Message) -> str:
        raise dedup.KeyExtractionError(f"bad key {huge}")

    for strategy in (fails, refuses):
        with pytest.raises(dedup.KeyExtractionError) as caught:
            keys.extract(strategy, msg())
        assert len(str(caught.value)) <= keys.MAX_REASON_CHARS
        assert "more characters)" in str(caught.value)


@given(st.text(min_size=1))
def test_any_text_id_round_trips_through_json_field(ident: str) -> None:
    try:
        value = orjson.dumps({"id": ident})
    except orjson.JSONEncodeError:
        return  # lone surrogates are not JSON
    as_given = keys.json_field("id")(msg(value))
    assert as_given == ("#" + ident if ident.startswith("#") else ident)
    assert keys.extract(keys.json_field("id"), msg(value)) == keys.stored(as_given)


def test_message_json_is_decoded_once() -> None:
    m = msg(b'{"a": 1}')
    assert m.json() is m.json()


def test_the_key_strategy_and_the_handler_share_one_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decodings: list[bytes] = []
    loads = orjson.loads

    def counted(value: bytes) -> Any:
        decodings.append(value)
        return loads(value)

    monkeypatch.setattr(orjson, "loads", counted)
    m = msg(b'{"id": "pay-1", "amount": 5}')
    m.idempotency_key = keys.extract(keys.json_field("id"), m)
    body = m.json()
    assert (m.idempotency_key, body, m.json() is body) == (
        "pay-1",
        {"id": "pay-1", "amount": 5},
        True,
    )
    assert decodings == [m.value], "decoded once, for the key and the handler"


@pytest.mark.parametrize(
    "strategy", [keys.json_field("id"), keys.json_field("id", "n"), keys.json_field("doc.id")]
)
def test_a_key_comes_from_the_bytes_sent_even_after_json_was_changed(
    strategy: keys.Strategy,
) -> None:
    value = b'{"id": "pay-1", "n": 7, "doc": {"id": "pay-1"}}'
    m = msg(value)
    body = m.json()
    body["id"] = "other"
    body.pop("n")
    body["doc"].clear()
    # A redelivery of the same bytes is a new message: it must get the same key.
    assert keys.extract(strategy, m) == keys.extract(strategy, msg(value))
    assert m.json() is body, "the caller's own object stays theirs"


def test_a_value_that_is_json_null_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    decodings: list[bytes] = []
    loads = orjson.loads
    monkeypatch.setattr(orjson, "loads", lambda value: decodings.append(value) or loads(value))
    m = msg(b"null")
    assert (m.json(), m.json(), len(decodings)) == (None, None, 1)


def test_a_replaced_value_is_decoded_anew() -> None:
    m = msg(b'{"id": "a"}')
    assert m.json() == {"id": "a"}
    changed = dataclasses.replace(m, value=b'{"id": "b"}')
    assert changed.json() == {"id": "b"}
    assert keys.extract(keys.json_field("id"), changed) == "b"


def test_a_message_from_a_record_keeps_what_the_record_holds() -> None:
    plain = dedup.Message.from_record(record(b'{"id": 1}', ()))
    assert (plain.where, plain.key, plain.value, plain.timestamp) == (
        "t:2:9",
        b"k",
        b'{"id": 1}',
        5,
    )
    assert (plain.headers, plain.raw_headers, plain.tombstone) == ({}, (), False)
    raw = (("a", b"1"), ("n", None), ("a", b"2"))
    many = dedup.Message.from_record(record(None, list(raw)))
    assert (many.headers, many.raw_headers) == ({"a": b"2", "n": b""}, raw)
    assert (many.value, many.tombstone) == (b"", True)
    plain.headers["x"] = b"y"
    assert dedup.Message.from_record(record(b"{}", ())).headers == {}, "a dict of its own"
    assert repr(plain) == (
        "Message(topic='t', partition=2, offset=9, key=b'k', value=b'{\"id\": 1}', "
        "headers={'x': b'y'}, timestamp=5, idempotency_key='', raw_headers=(), tombstone=False)"
    )
    assert plain != dedup.Message.from_record(record(b'{"id": 1}', ())), "one message, one record"


def record(value: bytes | None, headers: Any) -> ConsumerRecord[bytes, bytes]:
    size = 0 if value is None else len(value)
    return ConsumerRecord("t", 2, 9, 5, 0, b"k", value, None, 1, size, headers)
