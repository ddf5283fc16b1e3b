"""Kafka's own command-line tools, run the way a user runs them: ``compose/local/kafka-tool``.

The script runs a tool's Java class with the jars of the local broker (fetched
once by ``compose/local/kafka-libs``), so the tests produce with Kafka's console
producer and read a group's lag with Kafka's consumer-groups tool, not with
anything written here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from dedup_dev.services import ROOT

KAFKA_TOOL = ROOT / "compose" / "local" / "kafka-tool"
TIMEOUT = 180.0  # the first run may fetch the jars


@dataclass(frozen=True)
class Ran:
    """What a tool did."""

    returncode: int
    stdout: str
    stderr: str


async def run(tool: str, *args: str, stdin: str | None = None) -> Ran:
    """``compose/local/kafka-tool TOOL ARGS`` with ``stdin``; fails the test on a non-zero exit."""
    proc = await asyncio.create_subprocess_exec(
        KAFKA_TOOL,
        tool,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(
            proc.communicate(None if stdin is None else stdin.encode()), TIMEOUT
        )
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(
            f"kafka-tool {tool} {' '.join(args)} ran over {TIMEOUT:.0f}s"
        ) from None
    ran = Ran(proc.returncode or 0, out.decode(), err.decode())
    assert ran.returncode == 0, f"kafka-tool {tool} exited {ran.returncode}:\n{ran.stderr}"
    return ran


async def console_produce(
    bootstrap_servers: str, topic: str, lines: Sequence[str], *properties: str
) -> None:
    """Each line of ``lines`` produced by Kafka's console producer, with reader ``properties``."""
    args = ["--bootstrap-server", bootstrap_servers, "--topic", topic]
    for prop in properties:
        args += ["--property", prop]
    await run("console-producer", *args, stdin="".join(line + "\n" for line in lines))


async def group_lag(bootstrap_servers: str, group: str) -> dict[tuple[str, int], int | None]:
    """``{(topic, partition): lag}`` as Kafka's consumer-groups tool shows it (None for ``-``)."""
    ran = await run(
        "consumer-groups", "--bootstrap-server", bootstrap_servers, "--describe", "--group", group
    )
    lag: dict[tuple[str, int], int | None] = {}
    columns: list[str] = []
    for line in ran.stdout.splitlines():
        fields = line.split()
        if fields[:1] == ["GROUP"]:
            columns = fields
        elif columns and len(fields) == len(columns) and fields[0] == group:
            row = dict(zip(columns, fields, strict=True))
            value = row["LAG"]
            lag[(row["TOPIC"], int(row["PARTITION"]))] = None if value == "-" else int(value)
    assert lag, f"consumer-groups --describe --group {group} showed no partitions:\n{ran.stdout}"
    return lag
