"""The fenced code blocks of a docs page, and how the tests that run them run a console block.

A ``console`` block is a list of ``$ command`` lines, each followed by its
expected output; the command runs in ``/bin/sh`` and must print exactly that
(``...`` stands for anything on a line, or for any lines when alone).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from dedup_dev import helpers, kafka
from dedup_dev.services import ROOT

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
CLI_OFFSETS = "## `dedup offsets"
"""The heading of docs/reference/cli.md's section run by test_docs_offsets.py."""
CLI_MIGRATE = "## `dedup migrate`"
"""The heading of docs/reference/cli.md's section run by test_docs_migrate.py."""
AUDIT_ROLES = "## 4. Least privilege"
"""The heading of docs/howto/audit-and-purge.md's section run by test_roles.py (it makes roles)."""


def snippets(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of ``page``, in order."""
    return [(m[1], m[2]) for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


def checked_snippets(name: str, text: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of ``text``; every block must name its language."""
    found = [(m[1], m[2]) for m in BLOCK.finditer(text)]
    fences = re.findall(r"^```", text, re.MULTILINE)
    assert len(fences) == 2 * len(found), f"{name}: a code block without a language"
    return found


def _section_bounds(text: str, heading: str) -> tuple[int, int]:
    """Where the section whose heading line starts with ``heading`` begins and ends.

    It ends at the next heading of its level or a higher one (``## B`` ends
    ``### A``), outside code blocks (where ``# `` starts a comment).
    """
    level = len(heading.split(" ", 1)[0])
    start = text.index("\n" + heading) + 1
    at = start + len(heading)
    fenced = False
    for line in text[at:].splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", line):
            return start, at
        at += len(line)
    return start, len(text)


def section(text: str, heading: str) -> str:
    """The section of ``text`` under the heading line that starts with ``heading``."""
    start, end = _section_bounds(text, heading)
    return text[start:end]


def outside(text: str, heading: str) -> str:
    """``text`` without that section."""
    start, end = _section_bounds(text, heading)
    return text[:start] + text[end:]


def console(text: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            assert pairs, f"console block must start with a $ line: {line!r}"
            pairs[-1][1].append(line)
    return [(command, "\n".join(out)) for command, out in pairs]


def expected_pattern(expected: str) -> re.Pattern[str]:
    """``...`` alone on a line: any lines; inside a line: anything on that line."""
    parts = []
    for line in expected.splitlines():
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(map(re.escape, line.split("..."))) + r"\n")
    return re.compile("".join(parts), re.DOTALL)


def shell_env(dsn: str, bootstrap_servers: str) -> dict[str, str]:
    """The environment of a console command: this test's services, the venv's ``dedup``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "PG"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DEDUP_DSN"] = dsn
    env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap_servers
    return env


def run(command: str, env: dict[str, str], cwd: Path = ROOT, *, check: bool = False) -> str:
    """What ``command`` prints, stdout and stderr interleaved as on a terminal.

    With ``check``, it must exit 0 (a page's step that prints nothing to compare).
    """
    done = subprocess.run(
        ["/bin/sh", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )
    assert not check or done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}"
    return done.stdout


def columns(text: str) -> str:
    """Lines with their runs of blanks made one space (a table's widths follow its names)."""
    lines = [" ".join(line.split()) for line in text.strip("\n").splitlines()]
    return "".join(line + "\n" for line in lines)


async def until_committed(
    command: str,
    *,
    cwd: Path,
    env: dict[str, str],
    started: str,
    bootstrap_servers: str,
    group: str,
    topic: str,
    partitions: int,
) -> dict[int, int]:
    """Run a page's ``command``, a loop that consumes until Ctrl-C, until Kafka holds ``group``'s
    commit of every record of ``topic``; then Ctrl-C it.

    Its first line must be ``started``, and it must exit 0.  Returns the end
    offset of each partition that holds records (what was committed).
    """
    run = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", f"exec {command}", cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert run.stdout is not None
        first = await asyncio.wait_for(run.stdout.readline(), STARTED_WITHIN_S)
        assert first.decode() == started
        ends = await kafka.end_offsets(bootstrap_servers, topic, partitions)
        await committed_to(bootstrap_servers, group, topic, ends)
    finally:
        run.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = await asyncio.wait_for(run.communicate(), STOPPED_WITHIN_S)
    assert run.returncode == 0, err.decode()
    return {p: end for p, end in ends.items() if end}


async def committed_to(
    bootstrap_servers: str, group: str, topic: str, ends: dict[int, int]
) -> None:
    """Wait until ``group``'s committed offset of each partition of ``topic`` holding records
    is its end in ``ends``."""

    async def there() -> bool:
        found = await kafka.committed(bootstrap_servers, group, topic)
        return all(found.get(p) == end for p, end in ends.items() if end)

    await helpers.wait_for(there, what=f"{group}'s Kafka commit of every record", interval=0.5)


STARTED_WITHIN_S = 60.0
"""Seconds a page's loop may take to print its first line (it makes topics, sends records)."""
STOPPED_WITHIN_S = 30.0
"""Seconds a page's loop may take to exit after Ctrl-C."""
