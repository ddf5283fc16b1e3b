"""``python -m bench`` runs the benchmark; ``soak`` the memory soak; ``table-size`` throughput
against the number of keys stored."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["soak"]:
        from bench import soak

        sys.exit(soak.main(sys.argv[2:]))
    if sys.argv[1:2] == ["table-size"]:
        from bench import table_size

        sys.exit(table_size.main(sys.argv[2:]))
    from bench import run

    sys.exit(run.main(sys.argv[1:]))
