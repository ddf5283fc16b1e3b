"""notifications: send each notification once, through a transactional outbox.

A notification event (JSON)::

    {"notification_id": "n-1", "recipient": "u-1@example.com", "template": "paid", "data": {}}

The idempotency key is ``notification_id`` (namespace ``notifications``);
``date`` (optional) is the business date, else the record's UTC date.

Two processes, each started as many times as you like:

- the consumer (the default) writes each fresh notification to
  ``notifications.outbox`` in the transaction that claims its key, and sends
  nothing itself: an HTTP call cannot roll back with a transaction;
- the dispatcher (``--dispatcher``) claims due outbox rows (FOR UPDATE SKIP
  LOCKED), POSTs each to ``--receiver-url`` with its ``Idempotency-Key`` and
  ``X-Fencing-Token`` (the claim's token), retries failures with exponential
  backoff and marks rows sent (see consumers/dedup_services/outbox.py).

The receiver must handle a key once and refuse a token lower than one it saw
for that key; ``dedup run dedup_services.receiver`` is one that does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

import dedup
from dedup_services import outbox, service

log = logging.getLogger(__name__)

TASK = "notifications"

HOLD_AFTER_SEND = "NOTIFICATIONS_TEST_HOLD_AFTER_SEND"
"""Tests only: set, a dispatcher prints ``HELD <key> <token>`` after its first send and
then hangs before marking the row sent, to be killed there."""

WRITE = """
INSERT INTO notifications.outbox (idempotency_key, recipient, payload, business_date, source_token)
VALUES ($1, $2, $3::text::jsonb, $4, $5)
ON CONFLICT (idempotency_key) DO NOTHING
"""

RECONCILE = dedup.ReconcileCheck(
    task=TASK,
    source="SELECT count(*), NULL FROM notifications.outbox WHERE business_date = $1",
    result="SELECT count(*), NULL FROM notifications.outbox"
    " WHERE business_date = $1 AND status = 'sent'",
    source_label="notifications written to the outbox",
    result_label="notifications sent",
    description="notifications of the date written to the outbox vs sent to the receiver",
)


async def write(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Put the notification in the outbox, in the transaction that claims its key."""
    body = service.event(msg, "a notification")
    await tx.conn.execute(
        WRITE,
        msg.idempotency_key,
        service.text_field(body, "recipient"),
        msg.value.decode(),
        service.business_date(msg, body),
        tx.token,
    )


SERVICE = service.ConsumerService(
    name="notifications",
    description=__doc__ or "",
    handler=lambda group_id: write,
    key=dedup.keys.json_field("notification_id"),
    components=("notifications",),
)


# The flag and variable (after NOTIFICATIONS_) of each outbox.Settings field.
_FLAGS = {
    "claim_ttl": ("--claim-ttl", "CLAIM_TTL"),
    "timeout": ("--timeout", "SEND_TIMEOUT"),
    "max_attempts": ("--send-attempts", "SEND_ATTEMPTS"),
    "retry_base": ("--retry-base", "RETRY_BASE"),
    "retry_max": ("--retry-max", "RETRY_MAX"),
    "poll_interval": ("--poll-interval", "POLL_INTERVAL"),
    "batch_size": ("--dispatch-batch", "DISPATCH_BATCH"),
}


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
    for setting in dataclasses.fields(outbox.Settings):
        flag, env = _FLAGS[setting.name]
        service.option(
            group,
            flag,
            env=f"NOTIFICATIONS_{env}",
            default=setting.default,
            type=type(setting.default),
            help=setting.metadata["help"],
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
            try:
                # argparse keeps --send-attempts as send_attempts.
                settings = outbox.Settings(
                    **{
                        name: getattr(args, flag[2:].replace("-", "_"))
                        for name, (flag, _) in _FLAGS.items()
                    }
                )
                dispatcher = outbox.Dispatcher(
                    pool,
                    receiver_url=url,
                    holder=args.holder,
                    settings=settings,
                    after_send=_hold if os.environ.get(HOLD_AFTER_SEND) else None,
                )
            except ValueError as exc:
                raise dedup.ConfigurationError(str(exc)) from exc
            log.info("dispatching the outbox to %s as %s", url, dispatcher.holder)
            with service.stop_signals() as stop:
                await dispatcher.run(stop)
            log.info("dispatcher stopped: %s", dict(dispatcher.stats))
        finally:
            await pool.close()
    return 0


async def _hold(delivery: outbox.Delivery, status: int) -> None:
    print(f"HELD {delivery.key} {delivery.token} {status}", flush=True)
    await asyncio.Event().wait()


async def main(argv: list[str]) -> int:
    """``dedup run dedup_services.notifications [--dispatcher] [options]``: see ``--help``."""
    args = parser().parse_args(argv)
    if args.dispatcher:
        return await dispatch(args)
    return await SERVICE.run(args)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
