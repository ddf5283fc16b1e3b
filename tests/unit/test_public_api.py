"""The names outside code relies on (docs/reference/api.md) are exactly the public surface."""

from __future__ import annotations

import enum
import importlib
import inspect
import os
import pkgutil
import re
import socket
import subprocess
import sys
import tomllib

import pytest

import dedup
from dedup.cli import _main as cli
from dedup_dev.services import ROOT

CONTRACT = {
    "IdempotentConsumer",
    "Message",
    "Tx",
    "keys",
    "wrap",
    "migrate",
    "StaleTokenError",
    "TaskRunner",
    "TaskRun",
    "TaskOutcome",
    "Outcome",
    "claim",
}


def test_all_holds_the_contract_and_every_name_exists() -> None:
    assert CONTRACT <= set(dedup.__all__)
    assert all(hasattr(dedup, name) for name in dedup.__all__)
    assert sorted(dedup.__all__) == dedup.__all__


def test_every_public_name_has_a_docstring() -> None:
    for name in dedup.__all__:
        assert inspect.getdoc(getattr(dedup, name)), name


def test_faststream_middleware_imports_faststream_only_when_used() -> None:
    # dedup imports without the [faststream] extra: the middleware class is built on first use.
    exactly_once = dedup.FastStreamDedup(dsn="postgresql://x", namespace="n")
    assert "faststream" not in dedup._faststream.__dict__
    assert callable(exactly_once)


def test_faststream_middleware_refuses_wrong_settings() -> None:
    with pytest.raises(dedup.ConfigurationError, match="exactly one of dsn= or pool="):
        dedup.FastStreamDedup(namespace="n")
    with pytest.raises(dedup.ConfigurationError, match="max_attempts"):
        dedup.FastStreamDedup(dsn="postgresql://x", namespace="n", max_attempts=0)


def test_key_strategies_of_the_contract() -> None:
    for name in ("header", "json_field", "kafka_key", "offset", "first"):
        assert callable(getattr(dedup.keys, name))


def test_claim_signature_of_the_contract() -> None:
    params = inspect.signature(dedup.claim).parameters
    assert list(params)[:2] == ["conn", "records"]
    for name in ("namespace", "key"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert {"fresh", "duplicates", "conflicts"} <= set(dedup.ClaimResult.__dataclass_fields__)


def test_the_blocking_claim_takes_what_claim_takes() -> None:
    assert dedup.sync.__all__ == ["Consumer", "Tx", "claim", "publish"]
    for name in dedup.sync.__all__:
        assert inspect.getdoc(getattr(dedup.sync, name)), name
        assert getattr(dedup.sync, name).__module__ == "dedup.sync"
    twin, claim = (inspect.signature(f) for f in (dedup.sync.claim, dedup.claim))
    assert twin.parameters == claim.parameters
    # ClaimResult.publish(self, conn, ...) is dedup.sync.publish(result, conn, ...).
    publish, blocking = (
        [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()][1:]
        for f in (dedup.ClaimResult.publish, dedup.sync.publish)
    )
    assert blocking == publish


SHARED_SETTINGS = (
    *("key", "namespace", "schema", "batch_size", "batch", "holder", "on_missing_key"),
    *("on_conflict", "max_attempts", "handler_timeout", "kafka_commit_interval"),
    "install_signal_handlers",
)
"""The settings dedup.sync.Consumer shares with IdempotentConsumer: same names, same defaults."""


def test_the_blocking_consumer_takes_the_consumers_settings() -> None:
    blocking = inspect.signature(dedup.sync.Consumer).parameters
    consumer = inspect.signature(dedup.IdempotentConsumer).parameters
    assert next(iter(blocking)) == "handler"
    for name in ("topics", "group_id", "config", "dsn", "connection", *SHARED_SETTINGS):
        assert blocking[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    for name in SHARED_SETTINGS:
        assert blocking[name].default == consumer[name].default, name
    # tx.lock, tx.publish and tx.post: dedup.Tx's, blocking.
    for name in ("lock", "publish", "post"):
        twin, method = (
            [
                (p.name, p.kind, p.default)
                for p in inspect.signature(getattr(t, name)).parameters.values()
            ]
            for t in (dedup.sync.Tx, dedup.Tx)
        )
        assert twin == method, name
        assert inspect.getdoc(getattr(dedup.sync.Tx, name)), name
    for name in ("conn", "token", "namespace", "schema", "source"):
        assert hasattr(dedup.sync.Tx, name), name


def test_consumer_signature_of_the_contract() -> None:
    params = inspect.signature(dedup.IdempotentConsumer).parameters
    for name in (
        "topics",
        "group_id",
        "bootstrap_servers",
        "dsn",
        "pool",
        "key",
        "namespace",
        "batch_size",
        "install_signal_handlers",
    ):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert dedup._config.DEFAULT_BATCH_SIZE == 500


@pytest.mark.parametrize(
    ("policy", "setting", "choices"),
    [
        (dedup.OnConflict, "on_conflict", "'dead_letter' or 'record'"),
        (dedup.OnMissingKey, "on_missing_key", "'dead_letter' or 'offset'"),
    ],
)
async def test_policies_are_enums_that_take_their_plain_strings(
    policy: type[enum.StrEnum], setting: str, choices: str
) -> None:
    assert all(member == member.value and policy(member.value) is member for member in policy)
    with pytest.raises(dedup.ConfigurationError) as info:
        await dedup.claim(None, [], namespace="n", **{setting: "ignore"})
    assert str(info.value) == f"{setting}='ignore': expected {choices}"


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert dedup.__version__ == version
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"dedup (dedup-kafka) {version}\n"


PARTS = ["cli", "consumer", "data", "operations", "tasks"]
"""The library's folders by part (docs/architecture.md): private modules inside, nothing
exported."""
FACES = ["keys", "sync", "testing"]
"""The public modules beside ``dedup`` itself (docs/reference/api.md): the key strategies,
the blocking face and the test helpers."""


HIDDEN = ("_", "@")
"""Names no user imports: private ones, and those of pytest's assertion rewriting
(``@py_builtins``), which pytest adds to every module of a distribution with a
``pytest11`` plugin, as dedup-kafka is once its ``testing`` plugin is installed."""


def test_modules_other_than_the_faces_are_private() -> None:
    # The face is `dedup` itself (and `dedup.keys`, `dedup.sync` and `dedup.testing`,
    # documented as modules): everything else is free to change shape without breaking a user.
    found = pkgutil.iter_modules(dedup.__path__)
    public = sorted(m.name for m in found if not m.name.startswith("_") and m.name not in FACES)
    assert public == PARTS
    for name in PARTS:
        part = importlib.import_module(f"dedup.{name}")
        inside = [m.name for m in pkgutil.iter_modules(part.__path__)]
        assert inside and all(m.startswith("_") for m in inside), (name, inside)
        exported = [n for n in vars(part) if not n.startswith(HIDDEN) and n not in inside]
        assert exported == [], f"dedup.{name} exports {exported}: its face is `import dedup`"


def test_dedup_testing_exports_its_helpers_and_imports_no_pytest() -> None:
    import dedup.testing

    inside = [m.name for m in pkgutil.iter_modules(dedup.testing.__path__)]
    assert inside == ["_deliver", "_plugin", "_schema"]
    exported = sorted(
        n for n in vars(dedup.testing) if not n.startswith(HIDDEN) and n not in inside
    )
    assert exported == sorted(dedup.testing.__all__)
    for name in dedup.testing.__all__:
        value = getattr(dedup.testing, name)
        assert inspect.getdoc(value), name
        if callable(value):
            assert value.__module__ == "dedup.testing", name
    # The plugin alone imports pytest: `import dedup.testing` works without the extra.
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, dedup.testing; print('pytest' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout == "False\n"


def test_deliver_signature() -> None:
    import dedup.testing

    params = inspect.signature(dedup.testing.deliver).parameters
    assert list(params)[:2] == ["handler", "records"]
    for name in ("dsn", "pool", "namespace", "key", "schema", "max_attempts", "batch_size"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["max_attempts"].default == dedup._config.DEFAULT_MAX_ATTEMPTS == 3


def test_task_states_are_the_strings_stored_in_postgres() -> None:
    assert [str(s) for s in dedup.TaskState] == ["pending", "running", "succeeded", "failed"]
    assert dedup.TaskState("running") is dedup.TaskState.RUNNING


def test_default_holder_is_host_pid_and_six_hex_digits() -> None:
    first, second = dedup.default_holder(), dedup.default_holder()
    pattern = rf"{re.escape(socket.gethostname())}:{os.getpid()}:[0-9a-f]{{6}}"
    assert re.fullmatch(pattern, first), first
    assert first != second  # two holders of one process differ
