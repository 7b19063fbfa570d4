"""Each service's probes: /readyz until it is ready, then /healthz, /readyz and /stats
every liveness period; and the start-up deadline. The probe task only asks and posts what
it heard; the driver's loop hands the answers to the handlers here, one at a time
(readiness transitions, liveness misses), and applies at once the unit failure a handler
returns.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from supervisor.driver.child import ChildProcess
from supervisor.driver.child_probe import ChildProber, ProbeResult
from supervisor.driver.events import Handlers, TimerEvent, UnitFailed
from supervisor.driver.port import DriverPort
from supervisor.policy.child_lifecycle import ChildEvent, ChildState
from supervisor.policy.exit_codes import EXIT_LIVENESS, EXIT_STARTUP_TIMEOUT

LATE_SLACK_S = 1.0  # a probe round this much past its timeout means the supervisor itself stood still
# Figures a service may report on GET /stats; anything else it sends is ignored, except a
# "jobs" object, which is passed through as it is (size-capped here and by the probe).
STAT_KEYS = ("queue_depth", "in_flight", "served", "errors", "latency_p50_ms", "latency_p99_ms",
             "gpu_memory_bytes")
JOBS_MAX_BYTES = 16 * 1024


@dataclass(frozen=True)
class ReadyProbeAnswered:
    """A /readyz answer while the service starts (or the start-up deadline's recheck)."""
    child: ChildProcess
    result: ProbeResult


@dataclass(frozen=True)
class WatchRoundAnswered:
    """One liveness round: /healthz, /readyz and /stats, asked together."""
    child: ChildProcess
    health: ProbeResult
    ready: ProbeResult
    stats: ProbeResult


@dataclass(frozen=True)
class StartupDeadline(TimerEvent):
    """startup_timeout_s after the start: every service should be ready."""


class ServiceWatch:
    def __init__(self, port: DriverPort, probes: ChildProber):
        self.port = port
        self.probes = probes
        self._deadline_rechecked = False

    def handlers(self) -> Handlers:
        return {ReadyProbeAnswered: self._on_ready_probe, WatchRoundAnswered: self._on_watch_round,
                StartupDeadline: self._on_startup_deadline}

    async def probe_loop(self, child: ChildProcess) -> None:
        port, settings = self.port, self.port.settings
        while child.probing and not port.stopping:
            if child.state == ChildState.STARTING:
                answer = await self.probes.get(child, "/readyz", settings.liveness_timeout_s)
                port.post(ReadyProbeAnswered(child, answer))
                await port.clock.sleep(settings.readiness_period_s)
                continue
            await port.clock.sleep(settings.liveness_period_s)
            while child.probing and not port.stopping:
                began = port.clock.now()
                answers = await asyncio.gather(
                    self.probes.get(child, "/healthz", settings.liveness_timeout_s),
                    self.probes.get(child, "/readyz", settings.liveness_timeout_s),
                    self.probes.get(child, "/stats", settings.liveness_timeout_s))
                if port.clock.now() - began <= settings.liveness_timeout_s + LATE_SLACK_S or all(a.ok for a in answers):
                    port.post(WatchRoundAnswered(child, *answers))
                    break
                # A round cannot outlast its timeout unless this process did not run (frozen
                # with SIGSTOP, starved): what it saw is no evidence against the service.
                port.log_once(f"late-round:{child.name}", "warning",
                              f"{child.name}: a probe round took {port.clock.now() - began:.1f} s, past its "
                              f"{settings.liveness_timeout_s:g} s timeout (the supervisor was frozen or starved); "
                              f"probing again before counting a miss")
            else:
                return

    def _on_ready_probe(self, event: ReadyProbeAnswered) -> None:
        child, r = event.child, event.result
        if not child.probing or self.port.stopping:
            return
        if r.ok:
            child.fire(ChildEvent.READY_OK)
            child.ready_at = self.port.clock.now()
            child.last_probe_error = ""
            self.port.log.info(f"{child.name}: ready after {child.ready_at - child.started_at:.2f} s")
            return
        child.fire(ChildEvent.READY_LOST)
        child.last_probe_error = r.error or f"/readyz answered {r.status}"
        if r.foreign:
            self.port.log_once(f"foreign:{child.name}", "warning", f"{child.name}: {r.error}")

    def _on_watch_round(self, event: WatchRoundAnswered) -> list[UnitFailed] | None:
        child, health, ready = event.child, event.health, event.ready
        if not child.probing or self.port.stopping:
            return None
        absorb_stats(child, event.stats)
        settings = self.port.settings
        if health.ok:
            child.liveness_misses = 0
        else:
            child.liveness_misses += 1
            child.last_probe_error = health.error or f"/healthz answered {health.status}"
            self.port.log.warning(f"{child.name}: liveness miss {child.liveness_misses}/{settings.liveness_failures}: "
                                  f"{child.last_probe_error}")
            if child.liveness_misses >= settings.liveness_failures:
                return [UnitFailed(EXIT_LIVENESS, f"{child.name} failed {child.liveness_misses} liveness probes "
                                                  f"in a row ({child.last_probe_error})")]
        before = child.state
        after = child.fire(ChildEvent.READY_OK if ready.ok else ChildEvent.READY_LOST)
        if before == ChildState.READY and after == ChildState.NOT_READY:
            self.port.log.warning(f"{child.name}: not ready: {ready.error or f'/readyz answered {ready.status}'}")
        elif before == ChildState.NOT_READY and after == ChildState.READY:
            self.port.log.info(f"{child.name}: ready again")
        return None

    # ---- the start-up deadline ---------------------------------------------------------------
    def _on_startup_deadline(self, _: StartupDeadline) -> list[UnitFailed] | None:
        port = self.port
        late = [c for c in port.children if c.state in (ChildState.PENDING, ChildState.STARTING)]
        if port.stopping or not late:
            return None
        if not self._deadline_rechecked and any(c.state == ChildState.STARTING for c in late):
            # The last answers may be stale: a supervisor frozen (SIGSTOP) or starved past the
            # deadline saw nothing meanwhile, and that time is not the services' fault.
            self._deadline_rechecked = True
            port.start_task(self._recheck_late(late))
            return None
        for c in late:
            tail = "\n".join(f"    {line}" for line in c.tail.lines()[-10:]) or "    (no output)"
            why = f" (last probe: {c.last_probe_error})" if c.last_probe_error else ""
            port.log.error(f"{c.name} not ready after {port.settings.startup_timeout_s:g} s{why}; "
                           f"its last lines:\n{tail}")
        return [UnitFailed(EXIT_STARTUP_TIMEOUT, "start-up timeout: " + ", ".join(c.name for c in late))]

    async def _recheck_late(self, late: list[ChildProcess]) -> None:
        """One fresh /readyz of each late service, then the deadline is judged again."""
        port = self.port
        starting = [c for c in late if c.state == ChildState.STARTING]
        answers = await asyncio.gather(*(self.probes.get(c, "/readyz", port.settings.liveness_timeout_s)
                                         for c in starting))
        for c, r in zip(starting, answers, strict=True):
            port.post(ReadyProbeAnswered(c, r))
        port.post(StartupDeadline())


def absorb_stats(child: ChildProcess, result: ProbeResult) -> None:
    """What a service reports on /stats, kept for the status document: known figures only."""
    if not result.ok:
        return
    doc = result.doc()
    if not doc:
        return
    child.stats = {k: doc[k] for k in STAT_KEYS
                   if isinstance(doc.get(k), (int, float)) and not isinstance(doc.get(k), bool)}
    jobs = doc.get("jobs")
    if isinstance(jobs, dict) and len(json.dumps(jobs)) <= JOBS_MAX_BYTES:
        child.jobs = jobs
    else:
        child.jobs = None
    child.batching = batching_summary(doc.get("batching"))


def _figure(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def batching_summary(doc: Any) -> dict[str, Any] | None:
    """The few figures of a model service's batching and cost model worth a status line: the
    policy, the batches it chose, the time it waited, the learned curve, the memory held."""
    if not isinstance(doc, dict):
        return None
    cost = doc.get("cost") if isinstance(doc.get("cost"), dict) else {}
    time_model = cost.get("time") if isinstance(cost.get("time"), dict) else {}
    budgets = cost.get("budgets") if isinstance(cost.get("budgets"), dict) else {}
    policy = doc.get("policy")
    return {"policy": policy if isinstance(policy, str) and len(policy) <= 16 else None,
            "batches": _figure(doc.get("batches")), "mean_batch_size": _figure(doc.get("mean_batch_size")),
            "waited_s": _figure(doc.get("waited_s")), "fixed_ms": _figure(time_model.get("fixed_ms")),
            "per_extra_item_ms": _figure(time_model.get("per_extra_item_ms")),
            "held_bytes": _figure(cost.get("held_bytes")), "held_budget_bytes": _figure(budgets.get("held_bytes")),
            "call_budget_bytes": _figure(budgets.get("batch_bytes")),
            "refused_for_memory": _figure(cost.get("refused_for_memory"))}
