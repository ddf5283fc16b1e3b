"""dedup without an event loop: the blocking face, for psycopg and synchronous code.

``dedup.sync.claim`` is ``dedup.claim`` on a blocking ``psycopg.Connection``
(or an SQLAlchemy ``Session`` / ``Connection`` on psycopg), inside the
caller's transaction; ``dedup.sync.publish`` is ``ClaimResult.publish``.  A
Django view, a Celery task or a Flask handler calls them as it calls psycopg,
whether or not its thread has an event loop.

This part owns no logic of its own: each call runs dedup's async code on the
connection's blocking adapter (``dedup.data._psycopg``), driven to its end
by ``_drive.run``, which any blocking face of dedup uses the same way.  It
imports the layers below it and ``dedup.sync._drive``.
"""

from __future__ import annotations

from dedup.sync._claim import claim, publish
from dedup.sync._consumer import Consumer
from dedup.sync._handler import Tx

__all__ = ["Consumer", "Tx", "claim", "publish"]

for _name in __all__:
    globals()[_name].__module__ = "dedup.sync"
del _name
