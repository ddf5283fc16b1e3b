"""``python -m dedup``: the ``dedup`` command, for environments without the script on PATH."""

from dedup.cli._main import main

if __name__ == "__main__":
    raise SystemExit(main())
