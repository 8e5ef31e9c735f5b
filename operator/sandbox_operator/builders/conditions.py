"""Conditions as pure values, and the one merge every kind's status goes through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sandbox_operator.api.common import Condition, ConditionStatus

TRUE, FALSE, UNKNOWN = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN


@dataclass(frozen=True)
class Cond:
    """A condition as computed from one observation (no times, no generation)."""

    type: str
    status: str
    reason: str
    message: str = ""


def merge(
    previous: Sequence[Condition],
    current: Mapping[str, Cond | None],
    generation: int,
    now: str,
) -> list[Condition]:
    """The conditions after an observation.

    `current` names every condition type the kind declares, in display order: a
    Cond where it applies now, None where it does not (it is removed then).
    Nothing is dropped by omission: types `current` does not name are not ours
    (another controller's, a tool's) and are kept as they were.
    lastTransitionTime moves only when a condition's status flips."""
    before = {c.type: c for c in previous}
    merged: list[Condition] = []
    for kind, cond in current.items():
        if cond is None:
            continue
        if cond.type != kind:
            raise ValueError(f"condition {cond.type} computed for type {kind}")
        old = before.get(kind)
        since = old.last_transition_time if old and old.status == cond.status else None
        merged.append(
            Condition(
                type=cond.type,
                status=cond.status,
                reason=cond.reason,
                message=cond.message,
                last_transition_time=since or now,
                observed_generation=generation,
            )
        )
    merged.extend(c for c in previous if c.type not in current)
    return merged


RECONCILING, STALLED = "Reconciling", "Stalled"


def progress(ready: Cond, *, stalled: bool, settled: bool = False) -> dict[str, Cond | None]:
    """Reconciling and Stalled, the kstatus conditions Flux and `kstatus`-based
    tools read, from the kind's Ready condition. Both are "abnormal-true": present
    only while True (None removes them). Not Ready means Reconciling, unless the
    object cannot get further without a change (`stalled`: a bad spec, a final
    failure) or rests in a state the user asked for (`settled`: paused)."""
    if ready.status == TRUE or (settled and not stalled):
        return {RECONCILING: None, STALLED: None}
    if stalled:
        return {RECONCILING: None, STALLED: Cond(STALLED, TRUE, ready.reason, ready.message)}
    return {RECONCILING: Cond(RECONCILING, TRUE, ready.reason, ready.message), STALLED: None}


def find(conditions: Sequence[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.type == kind), None)
