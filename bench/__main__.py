"""``python -m bench`` runs the throughput benchmark; ``soak`` the memory soak; ``live`` the
live-stream latency; ``table-size`` throughput against the number of keys stored;
``relay`` the outbox relay's records per second against a bare producer; ``quick`` and
``full`` every section with every target (``make bench``, ``make bench-full``)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["soak"]:
        from bench import soak

        sys.exit(soak.main(sys.argv[2:]))
    if sys.argv[1:2] in (["quick"], ["full"]):
        from bench import suite

        sys.exit(suite.main(sys.argv[1:]))
    if sys.argv[1:2] == ["live"]:
        from bench import live

        sys.exit(live.main(sys.argv[2:]))
    if sys.argv[1:2] == ["relay"]:
        from bench import relay

        sys.exit(relay.main(sys.argv[2:]))
    if sys.argv[1:2] == ["table-size"]:
        from bench import table_size

        sys.exit(table_size.main(sys.argv[2:]))
    from bench import run

    sys.exit(run.main(sys.argv[1:]))
