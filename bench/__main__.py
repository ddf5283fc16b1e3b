"""``python -m bench`` runs the benchmark; ``python -m bench soak`` the memory soak."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["soak"]:
        from bench import soak

        sys.exit(soak.main(sys.argv[2:]))
    from bench import run

    sys.exit(run.main(sys.argv[1:]))
