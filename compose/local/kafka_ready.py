"""Exit 0 when a Kafka broker answers a Metadata request with at least N brokers (1).

Stdlib only, so ``compose/local/up`` can use it before the project's virtualenv
exists.  Usage: ``python3 kafka_ready.py HOST:PORT [TIMEOUT_SECONDS [N]]``.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

METADATA_API_KEY = 3
METADATA_VERSION = 4  # Kafka 4 removed v0-v3; v4 is still served and simple to parse.


def metadata_request(correlation_id: int) -> bytes:
    client_id = b"dedup-ready"
    header = struct.pack(
        ">hhih", METADATA_API_KEY, METADATA_VERSION, correlation_id, len(client_id)
    )
    body = struct.pack(">ib", -1, 0)  # all topics (null array), no auto-creation
    payload = header + client_id + body
    return struct.pack(">i", len(payload)) + payload


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        data += chunk
    return data


def broker_count(host: str, port: int) -> int:
    with socket.create_connection((host, port), timeout=3) as sock:
        sock.sendall(metadata_request(7))
        (size,) = struct.unpack(">i", recv_exactly(sock, 4))
        response = recv_exactly(sock, size)
    correlation_id, _throttle, brokers = struct.unpack(">iii", response[:12])
    if correlation_id != 7:
        raise ConnectionError(f"unexpected correlation id {correlation_id}")
    return int(brokers)


def main() -> int:
    host, _, port = sys.argv[1].rpartition(":")
    deadline = time.monotonic() + float(sys.argv[2] if len(sys.argv) > 2 else 0)
    need = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    while True:
        try:
            if broker_count(host, int(port)) >= need:
                return 0
        except (OSError, struct.error):
            pass
        if time.monotonic() >= deadline:
            return 1
        time.sleep(0.3)


if __name__ == "__main__":
    sys.exit(main())
