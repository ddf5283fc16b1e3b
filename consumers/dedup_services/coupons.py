"""coupons: at most one coupon per (user, campaign), whatever the duplicates.

A coupon request (JSON)::

    {"request_id": "req-1", "user_id": "u-1", "campaign": "black-friday", "value": 500}

``value`` (optional, default 0) is the coupon's worth in minor units; ``date``
(optional) the business date, else the record's UTC date.  Two layers keep it
to one coupon:

- the idempotency key (``request_id``, else an ``idempotency-key`` header, else
  the record's topic:partition:offset; namespace ``coupons``) makes a
  redelivered or replayed request a no-op;
- the business unique constraint (primary key (user_id, campaign) of
  ``coupons.coupons``) makes a *different* request for the same coupon (a
  double click, a client retrying with a new id) get the coupon already issued.

Every applied request gets a ``coupons.requests`` row saying ``issued`` or
``already_issued`` and which code.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys

import dedup
from dedup_services import service

log = logging.getLogger(__name__)

TASK = "coupons"

ISSUE = """
INSERT INTO coupons.coupons (user_id, campaign, code, value, request_key, business_date, token)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (user_id, campaign) DO NOTHING
RETURNING code
"""

# A separate statement from ISSUE: it sees a coupon that a concurrent
# transaction committed while ISSUE waited on the constraint.
RECORD = """
INSERT INTO coupons.requests (request_key, user_id, campaign, value, business_date, outcome,
                              coupon_code, token)
SELECT $1, $2, $3, $4, $5, CASE WHEN $6::text IS NULL THEN 'already_issued' ELSE 'issued' END,
       coalesce($6, (SELECT code FROM coupons.coupons WHERE user_id = $2 AND campaign = $3)), $7
RETURNING outcome, coupon_code
"""

RECONCILE = dedup.ReconcileCheck(
    task=TASK,
    # (user, campaign) pairs whose first applied request is of this date.
    source="""
        SELECT count(*), coalesce(sum(r.value), 0)
          FROM coupons.requests AS r
         WHERE r.business_date = $1
           AND NOT EXISTS (SELECT FROM coupons.requests AS e
                            WHERE e.user_id = r.user_id AND e.campaign = r.campaign
                              AND e.id < r.id)""",
    result="SELECT count(*), coalesce(sum(value), 0) FROM coupons.coupons WHERE business_date = $1",
    source_label="users x campaigns first requested",
    result_label="coupons issued",
    description="(user, campaign) pairs first requested on the date vs coupons issued",
)


async def issue(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Issue the request's coupon unless the user has it; record the request either way."""
    body = service.event(msg, "a coupon request")
    user_id = service.text_field(body, "user_id")
    campaign = service.text_field(body, "campaign")
    value = body.get("value", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise service.InvalidEvent(f"value must be a non-negative integer, not {value!r}")
    day = service.business_date(msg, body)
    code = f"{campaign[:16].upper()}-{secrets.token_hex(5).upper()}"
    issued = await tx.conn.fetchval(
        ISSUE, user_id, campaign, code, value, msg.idempotency_key, day, tx.token
    )
    row = await tx.conn.fetchrow(
        RECORD, msg.idempotency_key, user_id, campaign, value, day, issued, tx.token
    )
    log.info("coupon request %s: %s %s", msg.idempotency_key, row["outcome"], row["coupon_code"])


SERVICE = service.ConsumerService(
    name="coupons",
    description=__doc__ or "",
    handler=lambda group_id: issue,
    key=dedup.keys.first(dedup.keys.json_field("request_id"), dedup.keys.header("idempotency-key")),
    components=("coupons",),
    options={"on_missing_key": "offset"},
)


async def main(argv: list[str]) -> int:
    """``dedup run dedup_services.coupons [options]``; ``--help`` lists them."""
    return await SERVICE.main(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
