"""``make demo``'s program, small, on the test services; and the commands it tells you to run."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg

from tests.conftest import ROOT, Services


def test_demo_reports_zero_lost_zero_doubled_and_its_commands_work(
    services: Services, tmp_path: Path
) -> None:
    database = f"dedup_demo_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DEDUP_DSN": services.dsn,
        "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap_servers,
    }
    try:
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "consumers.demo",
                "--payments",
                "300",
                "--coupons",
                "100",
                "--notifications",
                "40",
                "--database",
                database,
                "--logs",
                str(tmp_path),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert demo.returncode == 0, demo.stdout + demo.stderr
        out = demo.stdout
        assert "RESULT: zero lost, zero doubled" in out
        assert "statements generated                    1" in out
        assert "payments OK, coupons OK, notifications OK, statements OK" in out
        commands = [line.strip() for line in out.splitlines() if line.startswith("  dedup ")]
        assert len(commands) == 4
        for command in commands:
            argv = shlex.split(command)
            ran = subprocess.run(
                [sys.executable, "-m", "dedup.cli", *argv[1:]],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert ran.returncode == 0, f"{command}:\n{ran.stdout}{ran.stderr}"
    finally:
        asyncio.run(_drop(services.dsn, database))


async def _drop(dsn: str, database: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        await conn.close()
