"""notifications: send each notification once, through dedup's outbox.

A notification event (JSON)::

    {"notification_id": "n-1", "recipient": "u-1@example.com", "template": "paid", "data": {}}

The idempotency key is ``notification_id`` (namespace ``notifications``);
``date`` (optional) is the business date, else the record's UTC date.

Two processes, each started as many times as you like:

- the consumer (the default) writes each fresh notification to dedup's
  outbox with ``tx.post("notifications", ...)``, in the transaction that
  claims its key, and sends nothing itself: an HTTP call cannot roll back
  with a transaction;
- the dispatcher (``--dispatcher``) is a :class:`dedup.Dispatcher` serving the
  destination ``notifications`` at ``--receiver-url``: it claims due outbox
  rows (FOR UPDATE SKIP LOCKED), POSTs each with its ``Idempotency-Key`` and
  ``X-Fencing-Token`` (the claim's token), retries failures with exponential
  backoff and marks rows sent.

The receiver must handle a key once and refuse a token lower than one it saw
for that key; ``dedup run dedup_services.receiver`` is one that does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import dedup
from dedup import _faults as faults
from dedup_services import service

log = logging.getLogger(__name__)

TASK = "notifications"

HOLD_AFTER_SEND = "NOTIFICATIONS_TEST_HOLD_AFTER_SEND"
"""Tests only: set, a dispatcher prints ``HELD <key> <token> <status>`` after its first send
and then hangs before marking the row sent, to be killed there."""

DESTINATION = "notifications"
"""The outbox destination the consumer posts to and the dispatcher serves."""

WRITTEN = """
INSERT INTO notifications.written
       (idempotency_key, recipient, business_date, outbox_key, source_token)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (idempotency_key) DO NOTHING
"""

RECONCILE = dedup.ReconcileCheck(
    task=TASK,
    source="SELECT count(*), NULL FROM notifications.written WHERE business_date = $1",
    result="SELECT count(*), NULL FROM notifications.written w"
    " JOIN {schema}.outbox o ON o.key = w.outbox_key"
    " WHERE w.business_date = $1 AND o.status = 'sent'",
    source_label="notifications written to the outbox",
    result_label="notifications sent",
    description="notifications of the date written to the outbox vs sent to the receiver",
)


async def write(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Post the notification to the outbox, in the transaction that claims its key."""
    body = service.event(msg, "a notification")
    outbox_key = await tx.post(DESTINATION, msg.value)
    await tx.conn.execute(
        WRITTEN,
        msg.idempotency_key,
        service.text_field(body, "recipient"),
        service.business_date(msg, body),
        outbox_key,
        tx.token,
    )


SERVICE = service.ConsumerService(
    name="notifications",
    description=__doc__ or "",
    handler=lambda group_id: write,
    key=dedup.keys.json_field("notification_id"),
    components=("notifications",),
)


# The dispatcher's settings: dedup.Dispatcher's name, the flag, the variable
# (after NOTIFICATIONS_), the default and what it means.
_SETTINGS = [
    ("claim_ttl", "--claim-ttl", "CLAIM_TTL", 30.0, "seconds a claim lasts (database clock)"),
    ("timeout", "--timeout", "SEND_TIMEOUT", 10.0, "seconds a send may take (< --claim-ttl)"),
    ("max_attempts", "--send-attempts", "SEND_ATTEMPTS", 8, "claims of a row before it is failed"),
    ("retry_base", "--retry-base", "RETRY_BASE", 1.0, "seconds before the first retry; doubles"),
    ("retry_max", "--retry-max", "RETRY_MAX", 60.0, "longest wait between retries"),
    ("poll_interval", "--poll-interval", "POLL_INTERVAL", 0.5, "seconds between looks when idle"),
    ("batch_size", "--dispatch-batch", "DISPATCH_BATCH", 10, "rows claimed and sent at once"),
]


def parser() -> argparse.ArgumentParser:
    """The consumer's flags, and the dispatcher's."""
    p = SERVICE.parser()
    group = p.add_argument_group("dispatcher (with --dispatcher)")
    group.add_argument(
        "--dispatcher", action="store_true", help="send the outbox instead of consuming"
    )
    service.option(
        group,
        "--receiver-url",
        env="NOTIFICATIONS_RECEIVER_URL",
        help="where to POST, e.g. http://127.0.0.1:8080/notifications",
    )
    for name, flag, env, default, meaning in _SETTINGS:
        service.option(
            group,
            flag,
            env=f"NOTIFICATIONS_{env}",
            default=default,
            type=type(default),
            help=meaning,
            dest=name,
        )
    return p


async def dispatch(args: argparse.Namespace) -> int:
    """Run one dispatcher until SIGTERM or SIGINT."""
    async with service.started(args, "notifications-dispatcher", SERVICE.components) as go_on:
        if not go_on:
            return 0
        url = service.require(args.receiver_url, "--receiver-url", "NOTIFICATIONS_RECEIVER_URL")
        pool = await service.connect(args.dsn)
        try:
            dispatcher = dedup.Dispatcher(
                pool=pool,
                destinations={DESTINATION: url},
                holder=args.holder,
                **{name: getattr(args, name) for name, *_ in _SETTINGS},
            )
            if os.environ.get(HOLD_AFTER_SEND):
                faults.install(faults.Point.DISPATCH_AFTER_POST, _hold)
            log.info("dispatching the outbox to %s as %s", url, dispatcher.holder)
            with service.stop_signals() as stop:
                running = asyncio.create_task(dispatcher.run())
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                await dispatcher.stop()
                await running  # its sends in flight marked, or its error raised
            log.info("dispatcher stopped: %s", dict(dispatcher.stats))
        finally:
            await pool.close()
    return 0


async def _hold(*, key: str, token: int, status: int) -> None:
    print(f"HELD {key} {token} {status}", flush=True)
    await asyncio.Event().wait()


async def main(argv: list[str]) -> int:
    """``dedup run dedup_services.notifications [--dispatcher] [options]``: see ``--help``."""
    args = parser().parse_args(argv)
    if args.dispatcher:
        return await dispatch(args)
    return await SERVICE.run(args)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
