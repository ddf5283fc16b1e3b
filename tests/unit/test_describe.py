"""A handler's exception as a dead letter stores it: typed, masked, bounded (dedup._handler)."""

from __future__ import annotations

from dedup import _handler as handler


class InvalidEvent(ValueError):
    pass


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_an_exception_is_its_type_and_message() -> None:
    described = handler.describe(InvalidEvent("amount must be an integer in minor units"))
    assert described == "InvalidEvent: amount must be an integer in minor units"
    assert handler.describe(TimeoutError()) == "TimeoutError"
    assert handler.describe(Unprintable()) == (
        "Unprintable: (the exception's message could not be read)"
    )


def test_a_long_message_is_cut_to_the_bound_and_says_so() -> None:
    described = handler.describe(ValueError("x" * 10_000))
    assert len(described) == handler.MAX_ERROR_LENGTH
    assert described.startswith("ValueError: xxx")
    assert described.endswith("x" + handler.CUT)
    exact = "ValueError: " + "x" * (handler.MAX_ERROR_LENGTH - len("ValueError: "))
    assert handler.describe(ValueError(exact.removeprefix("ValueError: "))) == exact


def test_credentials_are_masked_before_the_cut_so_none_is_left_in_part() -> None:
    secret = "hunter2-" + "p" * 40
    # The secret straddles the bound: cut first, its first half would survive.
    message = "y" * (handler.MAX_ERROR_LENGTH - 30) + f" {secret} " + "z" * 100
    described = handler.describe(RuntimeError(message), {secret})
    assert "hunter2" not in described
    assert " *** zzz" in described
    assert len(described) == handler.MAX_ERROR_LENGTH
    url = handler.describe(ConnectionError("cannot reach https://svc:pw-9911@ledger/api"))
    assert url == "ConnectionError: cannot reach https://svc:***@ledger/api"
