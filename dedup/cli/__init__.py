"""The ``dedup`` command: its parser, its commands and what they share.

``_main`` builds the parser and runs ``task run`` and ``run`` itself; ``_migrate``,
``_audit`` (audit, events, dead-letters, purge, reconcile) and ``_offsets`` hold
the other commands, over ``_common`` (connection options, exit codes, output).

The top layer beside ``import dedup``: these modules may import any other part
of the library, and nothing in the library imports them.
"""
