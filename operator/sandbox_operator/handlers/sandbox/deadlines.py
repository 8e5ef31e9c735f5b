"""When a Sandbox needs its next pass if nothing happens to it meanwhile. Pure.

Events (the Sandbox's own, its pod's, its claim's) start passes by themselves;
what no event announces is time running out. Each pass therefore ends by
working out the earliest moment at which a pass would decide something else
than this one did (`next_pass`), and the operator's one clock starts the
Sandbox's next pass then (`timetable.Timetable`). The decisions it follows,
each beside its deadline:

- the end of the lease or of the maximum lifetime (`status.expiresAt`) and of
  `pausedTimeout` (`status.pausedDeadline`): lifecycle.decide_lifecycle;
- a running sandbox's agent report (activity, workspace usage, the cgroup
  counters of PidLimitReached and CpuThrottled): every
  `reconcile_interval_seconds`, and at its idle deadline if that comes first;
- a claim of an Immediate class not bound yet (why, from its Events) and a
  workspace being restored: every `reconcile_interval_seconds`;
- a pod left unscheduled on its claim, an agent not ready in a pod that
  served: when their patience runs out (pod.decide_pod);
- nothing else: `resync_interval_seconds` (spread by the UID so that a
  restarted operator's Sandboxes do not all come back at once), against an
  event lost in a way the watches cannot see.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import SandboxPhase, SandboxStatus
from sandbox_operator.builders import sandbox_status
from sandbox_operator.clock import parse_time
from sandbox_operator.config import Settings
from sandbox_operator.handlers.sandbox.pod import UNBOUND_CLAIM_PATIENCE, agent_unready_since

JSON = dict[str, Any]

# A deadline is acted on by a pass at or after it: wake a little after, not
# a little before, whatever the rounding of the times in status.
MARGIN = timedelta(milliseconds=100)
# Resyncs fall between 0.9 and 1.1 times the interval, by UID.
RESYNC_SPREAD = 0.2


@dataclass(frozen=True)
class NextPass:
    at: datetime
    why: str  # for the log and the metric's label

    def seconds_from(self, now: datetime) -> float:
        return (self.at - now).total_seconds()


def next_pass(
    status: SandboxStatus,
    pod: JSON | None,
    *,
    uid: str,
    claim_wait: bool,
    restoring: bool,
    now: datetime,
    settings: Settings,
) -> NextPass:
    """The earliest moment a pass of this Sandbox would decide differently from
    the one at `now` that arrived at `status` with `pod`, and why (see the
    module's docstring)."""
    interval = timedelta(seconds=settings.reconcile_interval_seconds)
    candidates = [NextPass(now + resync_after(uid, settings), "resync")]

    def deadline(when: str | datetime | None, why: str) -> None:
        if when is None:
            return
        at = (parse_time(when) if isinstance(when, str) else when) + MARGIN
        # One in the past was acted on by this pass (or is waited on by another
        # of the reasons here): looking again at once would only spin.
        if at > now:
            candidates.append(NextPass(at, why))

    deadline(status.expires_at, "expiry")
    deadline(status.paused_deadline, "paused timeout")
    if status.phase == SandboxPhase.RUNNING:
        deadline(status.idle_deadline, "idle deadline")
        candidates.append(NextPass(now + interval, "agent report"))
    if status.idle_snapshot:
        candidates.append(NextPass(now + interval, "idle snapshot"))
    if claim_wait:
        candidates.append(NextPass(now + interval, "claim binding"))
    if restoring:
        candidates.append(NextPass(now + interval, "workspace restore"))
    if pod is not None and not pod["metadata"].get("deletionTimestamp"):
        if (since := sandbox_status.unbound_claim_since(pod)) is not None:
            deadline(since + UNBOUND_CLAIM_PATIENCE, "unscheduled on its claim")
        if (since := agent_unready_since(pod, status)) is not None:
            deadline(since + parse_duration(settings.agent_unready_patience), "agent not ready")
    return min(candidates, key=lambda c: c.at)


def resync_after(uid: str, settings: Settings) -> timedelta:
    """The resync interval, spread over +-10 % by the UID (stable for one Sandbox)."""
    share = (zlib.crc32(uid.encode()) % 1000) / 1000  # 0 <= share < 1
    factor = 1 - RESYNC_SPREAD / 2 + RESYNC_SPREAD * share
    return timedelta(seconds=settings.resync_interval_seconds * factor)


def resync_seconds(uid: str, settings: Settings) -> float:
    """`resync_after` in seconds: the time a pass sets when nothing else is due."""
    return resync_after(uid, settings).total_seconds()
