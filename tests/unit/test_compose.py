"""compose/docker-compose.yml promises what compose/local/up and the README promise.

No Docker engine runs here, so the file is checked as data; where a compose
client is installed (``docker compose`` or Debian's ``docker-compose``) it also
validates the file with ``config``.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import yaml

from dedup_dev.services import ROOT

COMPOSE = ROOT / "compose" / "docker-compose.yml"


def test_compose_runs_the_kafka_version_that_local_up_runs() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    pom = (ROOT / "compose" / "local" / "kafka-pom.xml").read_text()
    version = re.search(r"<kafka.version>(.+)</kafka.version>", pom)
    assert version
    assert services["kafka"]["image"] == f"apache/kafka:{version[1]}"
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_compose_ports_and_variables_match_the_readme() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    readme = (ROOT / "README.md").read_text()
    assert "127.0.0.1:9092:9092" in services["kafka"]["ports"]
    assert "127.0.0.1:5432:5432" in services["postgres"]["ports"]
    assert "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092" in readme
    assert "DEDUP_DSN=postgresql://postgres@127.0.0.1:5432/postgres" in readme
    for name, service in services.items():
        if "build" in service:
            env = service["environment"]
            assert env["DEDUP_DSN"].startswith("postgresql://postgres@postgres:5432/"), name


def test_compose_services_send_traces_to_jaeger_and_serve_metrics() -> None:
    # The services export nothing unless told: the file names each signal's exporter.
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if "build" in service and "migrate" not in name:
            env = service["environment"]
            assert env["OTEL_TRACES_EXPORTER"] == "otlp", name
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
            assert env["OTEL_METRICS_EXPORTER"] == "prometheus", name
            assert env["OTEL_LOGS_EXPORTER"] == "none", name


def test_compose_file_is_valid_for_the_installed_client() -> None:
    clients = [
        [docker, "compose"]
        for docker in [shutil.which("docker")]
        if docker
        and subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ]
    if legacy := shutil.which("docker-compose"):
        clients.append([legacy])
    for client in clients:
        checked = subprocess.run(
            [*client, "-f", str(COMPOSE), "config", "-q"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert checked.returncode == 0, checked.stderr
    # Parsing as YAML is the check that holds on every machine.
    assert yaml.safe_load(COMPOSE.read_text())["services"]
