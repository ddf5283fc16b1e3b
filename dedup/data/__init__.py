"""Postgres: the named queries, pools and connections, drivers, migrations, the events table.

``_sql`` loads the statements of the top-level ``sql/`` (``dedup/sql`` in the
wheel) and runs them; ``_db`` opens pools and connections and knows which
database errors are worth a retry; ``_drivers`` finds the connection to run
on beneath what a caller hands (asyncpg, psycopg, SQLAlchemy on either);
``_psycopg`` gives a psycopg connection, async or blocking, asyncpg's methods;
``_migrations`` applies ``sql/migrations``; ``_events`` writes the audit's
events; ``_conninfo`` reads DSNs without printing a password;
``_db_telemetry`` makes each statement a CLIENT span.

They import only the basics (errors, telemetry, limits) and each other;
everything that talks to Postgres imports them.
"""
