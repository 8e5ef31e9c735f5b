"""A new Sandbox that names a pool claims a member in the round of the event
that announced it, ahead of Kopf's change handlers.

A claim converges the Sandbox completely, so it is marked handled (Kopf's
diff base, with Kopf's finalizer) and no creation handler follows. Three
writes in all, Ready after two rounds: the claim and that mark at once, then
the status, which Kopf writes with the round's patch (see
`bookkeeping.mark_handled` for why in that order). When no claim happens
(start cold, or wait for a member), the mark is taken back and the change
handlers take over as for any Sandbox.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

import kopf

from sandbox_operator import bookkeeping, errors
from sandbox_operator.builders.pool import claimed
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.reconcile import Children, reconcile, refused
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import KubeError
from sandbox_operator.resources import SANDBOXES


async def claim_on_arrival(
    ctx: OperatorContext,
    body: kopf.Body,
    patch: kopf.Patch,
    logger: kopf.Logger,
    indexes: Indexes,
) -> None:
    """Claim for a new Sandbox that names a pool (`builders.pool.awaits_claim`)."""
    path = SANDBOXES.path(body["metadata"]["namespace"], body["metadata"]["name"])
    marking = asyncio.create_task(bookkeeping.mark_handled(ctx.kube, path, body))
    took = False
    try:
        # The change handler retries whatever this pass could not do.
        with suppress(kopf.PermanentError, kopf.TemporaryError):
            async with errors.policy("Sandbox", "claim", refused(ctx, dict(body))):
                status = await reconcile(
                    ctx,
                    dict(body),
                    logger,
                    children=Children.POD,
                    status_into=patch,
                    indexes=indexes,
                )
                took = claimed({"status": status or {}})
    finally:
        try:
            marked = await marking
        except KubeError as exc:
            logger.warning("could not mark the claim handled: %s", exc)
            marked = False
    if took and not marked:
        bookkeeping.mark_in_patch(body, patch)  # changed meanwhile: beside Kopf's finalizer
    elif marked and not took:
        await bookkeeping.unmark(ctx.kube, path)
