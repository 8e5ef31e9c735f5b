"""A new Sandbox is converged in the round of the event that announced it,
ahead of Kopf's change handlers: a claim of a pool member for one that names
a pool, its children for any other.

Such a pass converges the Sandbox completely, so it is marked handled
(Kopf's diff base, with Kopf's finalizer) and no creation handler follows.
A claim is three writes in all, Ready after two rounds: the claim and that
mark at once, then the status, which Kopf writes with the round's patch
(see `bookkeeping.mark_handled` for why in that order). A cold creation is
the mark beside its four children, then the status: six writes and one
round where the change handlers took seven and three (Kopf's finalizer in a
round of its own, the creation handler's status and Kopf's diff base after
it). When the pass does not converge the Sandbox (no member to claim, a
quota, an error), the mark is taken back and the change handlers take over
as for any Sandbox.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

import kopf

from sandbox_operator import bookkeeping, errors
from sandbox_operator.builders.pool import awaits_claim, claimed
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.reconcile import Children, reconcile, refused
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import KubeError
from sandbox_operator.resources import SANDBOXES


def arrives(body: kopf.Body) -> bool:
    """A Sandbox to converge at its arrival: one that awaits a pool claim, or one
    that names no pool and that no change handler has handled yet."""
    sandbox = dict(body)
    if awaits_claim(sandbox):
        return True
    return (
        not ((sandbox.get("spec") or {}).get("poolRef") or {}).get("name")
        and not sandbox["metadata"].get("deletionTimestamp")
        and not bookkeeping.handled(body)
    )


async def converge_on_arrival(
    ctx: OperatorContext,
    body: kopf.Body,
    patch: kopf.Patch,
    logger: kopf.Logger,
    indexes: Indexes,
) -> None:
    """Claim a member for, or create the children of, a Sandbox that `arrives`."""
    claim = awaits_claim(dict(body))
    path = SANDBOXES.path(body["metadata"]["namespace"], body["metadata"]["name"])
    marking = asyncio.create_task(bookkeeping.mark_handled(ctx.kube, path, body))
    took = False
    try:
        # The change handler retries whatever this pass could not do.
        with suppress(kopf.PermanentError, kopf.TemporaryError):
            trigger = "claim" if claim else "create"
            async with errors.policy("Sandbox", trigger, refused(ctx, dict(body))):
                status = await reconcile(
                    ctx,
                    dict(body),
                    logger,
                    children=Children.POD if claim else Children.CREATE,
                    status_into=patch,
                    indexes=indexes,
                )
                took = claimed({"status": status or {}}) if claim else status is not None
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
