"""payments: deduct each payment from its account once, however often it is delivered.

A payment event (JSON)::

    {"payment_id": "pay-1", "account": "acc-1", "amount": 2500, "date": "2026-11-30"}

``amount`` is a positive integer in minor units; ``date`` is the business date
(default: the record's UTC date).  Produce it with the account as Kafka key, so
an account's payments keep their order on one partition.  The idempotency key
is ``payment_id``; keys live in namespace ``payments``.

For a fresh payment, inside the consumer's transaction:

- applied: the balance goes down by a conditional UPDATE that carries the
  batch's fencing token (the account row keeps the token of its last
  deduction, and an older token of the same partition lease is refused with
  dedup.StaleTokenError, rolling the batch back); a ``payments.payments`` row
  says ``applied`` and a ``payments.postings`` row records the change;
- rejected: insufficient funds, an unknown account or a non-positive amount is
  a business outcome: a ``payments.payments`` row says ``rejected`` and why;
  the balance is untouched and nothing is retried.

A malformed event (a missing field, a wrong type) is an error: retried
``--max-attempts`` times, then dead-lettered whole.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import sys
from dataclasses import dataclass

import dedup
from dedup_services import service

log = logging.getLogger(__name__)

TASK = "payments"

DEDUCT = """
WITH debited AS (
    UPDATE payments.accounts
       SET balance = balance - $3, fence_resource = $5, fence_token = $6, updated_at = now()
     WHERE account = $2
       AND balance >= $3
       AND (fence_resource IS DISTINCT FROM $5 OR fence_token <= $6)
       AND NOT EXISTS (SELECT FROM payments.payments WHERE payment_id = $1)
    RETURNING account, balance
), decided AS (
    INSERT INTO payments.payments (payment_id, account, amount, business_date, status,
                                   balance_after, token, topic, "partition", "offset")
    SELECT $1, account, $3, $4, 'applied', balance, $6, $7, $8, $9 FROM debited
)
INSERT INTO payments.postings (payment_id, account, amount, balance_after, business_date, token)
SELECT $1, account, $3, balance, $4, $6 FROM debited
RETURNING balance_after
"""

# Why DEDUCT changed nothing; the lock keeps the answer true until COMMIT.
INSPECT = """
SELECT balance, fence_resource, fence_token,
       (SELECT status FROM payments.payments WHERE payment_id = $1) AS decided
  FROM payments.accounts
 WHERE account = $2
   FOR UPDATE
"""

REJECT = """
INSERT INTO payments.payments (payment_id, account, amount, business_date, status, reason,
                               balance_after, token, topic, "partition", "offset")
VALUES ($1, $2, $3, $4, 'rejected', $5, $6, $7, $8, $9, $10)
ON CONFLICT (payment_id) DO NOTHING
"""

RECONCILE = dedup.ReconcileCheck(
    task=TASK,
    source="SELECT count(*), coalesce(sum(amount), 0) FROM payments.payments"
    " WHERE business_date = $1 AND status = 'applied'",
    result="SELECT count(*), coalesce(sum(amount), 0) FROM payments.postings"
    " WHERE business_date = $1",
    source_label="applied payments",
    result_label="balance postings",
    description="payments applied on the date vs the balance changes posted for them",
)


@dataclass(frozen=True)
class Payment:
    """One payment event, checked."""

    payment_id: str
    """Its idempotency key."""
    account: str
    """The account to deduct from."""
    amount: int
    """Minor units."""
    business_date: dt.date
    """The day it belongs to."""

    @classmethod
    def from_message(cls, msg: dedup.Message) -> Payment:
        """Read and check the event; InvalidEvent says what is malformed."""
        body = service.event(msg, "a payment")
        amount = body.get("amount")
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise service.InvalidEvent(f"amount must be an integer in minor units, not {amount!r}")
        return cls(
            payment_id=msg.idempotency_key,
            account=service.text_field(body, "account"),
            amount=amount,
            business_date=service.business_date(msg, body),
        )


class Deductions:
    """The handler of one consumer group: deduct, or record a rejection."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id

    async def __call__(self, msg: dedup.Message, tx: dedup.Tx) -> None:
        payment = Payment.from_message(msg)
        if payment.amount <= 0:
            await self._reject(msg, tx, payment, "amount must be positive", None)
            return
        # Tokens order the owners of one partition lease only.
        resource = f"{self.group_id}:{msg.topic}:{msg.partition}"
        if await self._deduct(msg, tx, payment, resource):
            return
        account = await tx.conn.fetchrow(INSPECT, payment.payment_id, payment.account)
        if account is None:
            await self._reject(msg, tx, payment, "unknown account", None)
        elif account["decided"] is not None:
            log.info("payment %s was %s before", payment.payment_id, account["decided"])
        elif account["fence_resource"] == resource and account["fence_token"] > tx.token:
            raise dedup.StaleTokenError(
                resource,
                tx.token,
                f"account {payment.account} was debited under fencing token "
                f"{account['fence_token']} of {resource}; this batch runs under {tx.token}: "
                "a newer owner has the partition",
            )
        elif account["balance"] < payment.amount:
            reason = f"insufficient funds: balance {account['balance']} < amount {payment.amount}"
            await self._reject(msg, tx, payment, reason, account["balance"])
        elif not await self._deduct(msg, tx, payment, resource):
            # The row is locked and every condition holds: this cannot be reached.
            raise RuntimeError(f"payment {payment.payment_id}: deduction refused unexpectedly")

    async def _deduct(
        self, msg: dedup.Message, tx: dedup.Tx, payment: Payment, resource: str
    ) -> bool:
        balance = await tx.conn.fetchval(
            DEDUCT,
            payment.payment_id,
            payment.account,
            payment.amount,
            payment.business_date,
            resource,
            tx.token,
            msg.topic,
            msg.partition,
            msg.offset,
        )
        return balance is not None

    async def _reject(
        self,
        msg: dedup.Message,
        tx: dedup.Tx,
        payment: Payment,
        reason: str,
        balance: int | None,
    ) -> None:
        log.info("payment %s rejected: %s", payment.payment_id, reason)
        await tx.conn.execute(
            REJECT,
            payment.payment_id,
            payment.account,
            payment.amount,
            payment.business_date,
            reason,
            balance,
            tx.token,
            msg.topic,
            msg.partition,
            msg.offset,
        )


SERVICE = service.ConsumerService(
    name="payments",
    description=__doc__ or "",
    handler=Deductions,
    key=dedup.keys.json_field("payment_id"),
    components=("payments",),
)


async def main(argv: list[str]) -> int:
    """``dedup run dedup_services.payments [options]``; ``--help`` lists them."""
    return await SERVICE.main(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
