"""Each service's probes: /readyz until it is ready, then /healthz, /readyz and /stats
every liveness period. The probe task only asks and enqueues what it heard; the driver's
loop applies the answers here, one at a time (readiness transitions, liveness misses).
"""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor import report
from supervisor.child import ChildProcess
from supervisor.lifecycle import EXIT_LIVENESS, EXIT_STARTUP_TIMEOUT, Event, State, UnitEvent

LATE_SLACK_S = 1.0  # a probe round this much past its timeout means the supervisor itself stood still


class ServiceWatch:
    def __init__(self, sup: Any):
        self.sup = sup  # the driver (unit.Supervisor)
        self._deadline_rechecked = False

    async def probe_loop(self, child: ChildProcess) -> None:
        s = self.sup.settings
        while child.probing and not self.sup.unit.stopping:
            if child.state == State.STARTING:
                self.sup.put("ready_probe", child, await self.sup.probes.get(child, "/readyz", s.liveness_timeout_s))
                await self.sup.clock.sleep(s.readiness_period_s)
                continue
            await self.sup.clock.sleep(s.liveness_period_s)
            while child.probing and not self.sup.unit.stopping:
                began = self.sup.clock.now()
                answers = await asyncio.gather(
                    self.sup.probes.get(child, "/healthz", s.liveness_timeout_s),
                    self.sup.probes.get(child, "/readyz", s.liveness_timeout_s),
                    self.sup.probes.get(child, "/stats", s.liveness_timeout_s))
                if self.sup.clock.now() - began <= s.liveness_timeout_s + LATE_SLACK_S or all(a.ok for a in answers):
                    self.sup.put("watch_probe", child, *answers)
                    break
                # A round cannot outlast its timeout unless this process did not run (frozen
                # with SIGSTOP, starved): what it saw is no evidence against the service.
                self.sup.log_once(f"late-round:{child.name}", "warning",
                                  f"{child.name}: a probe round took {self.sup.clock.now() - began:.1f} s, past its "
                                  f"{s.liveness_timeout_s:g} s timeout (the supervisor was frozen or starved); "
                                  f"probing again before counting a miss")
            else:
                return

    def on_ready_probe(self, child: ChildProcess, r) -> None:
        if not child.probing or self.sup.unit.stopping:
            return
        if r.ok:
            child.fire(Event.READY_OK)
            child.ready_at = self.sup.clock.now()
            child.last_probe_error = ""
            self.sup.log.info(f"{child.name}: ready after {child.ready_at - child.started_at:.2f} s")
            return
        child.fire(Event.READY_LOST)
        child.last_probe_error = r.error or f"/readyz answered {r.status}"
        if r.foreign:
            self.sup.log_once(f"foreign:{child.name}", "warning", f"{child.name}: {r.error}")

    def on_watch(self, child: ChildProcess, health, ready, stats) -> None:
        if not child.probing or self.sup.unit.stopping:
            return
        report.absorb_stats(child, stats)
        s = self.sup.settings
        if health.ok:
            child.liveness_misses = 0
        else:
            child.liveness_misses += 1
            child.last_probe_error = health.error or f"/healthz answered {health.status}"
            self.sup.log.warning(f"{child.name}: liveness miss {child.liveness_misses}/{s.liveness_failures}: "
                             f"{child.last_probe_error}")
            if child.liveness_misses >= s.liveness_failures:
                self.sup.apply(self.sup.unit.fire(UnitEvent.FAIL, EXIT_LIVENESS,
                                           f"{child.name} failed {child.liveness_misses} liveness probes "
                                           f"in a row ({child.last_probe_error})"))
                return
        before = child.state
        after = child.fire(Event.READY_OK if ready.ok else Event.READY_LOST)
        if before == State.READY and after == State.NOT_READY:
            self.sup.log.warning(f"{child.name}: not ready: {ready.error or f'/readyz answered {ready.status}'}")
        elif before == State.NOT_READY and after == State.READY:
            self.sup.log.info(f"{child.name}: ready again")

    # ---- the start-up deadline ---------------------------------------------------------------
    def on_startup_deadline(self) -> None:
        sup = self.sup
        sup.reap_now()  # a frozen supervisor resumes with exits and the timer both due: exits first
        late = [c for c in sup.children if c.state in (State.PENDING, State.STARTING)]
        if sup.unit.stopping or not late:
            return
        if not self._deadline_rechecked and any(c.state == State.STARTING for c in late):
            # The last answers may be stale: a supervisor frozen (SIGSTOP) or starved past the
            # deadline saw nothing meanwhile, and that time is not the services' fault.
            self._deadline_rechecked = True
            sup.spawn_task(self._recheck_late(late))
            return
        for c in late:
            tail = "\n".join(f"    {line}" for line in c.tail.lines()[-10:]) or "    (no output)"
            why = f" (last probe: {c.last_probe_error})" if c.last_probe_error else ""
            sup.log.error(f"{c.name} not ready after {sup.settings.startup_timeout_s:g} s{why}; "
                          f"its last lines:\n{tail}")
        sup.apply(sup.unit.fire(UnitEvent.FAIL, EXIT_STARTUP_TIMEOUT,
                                "start-up timeout: " + ", ".join(c.name for c in late)))

    async def _recheck_late(self, late: list[ChildProcess]) -> None:
        """One fresh /readyz of each late service, then the deadline is judged again."""
        sup = self.sup
        starting = [c for c in late if c.state == State.STARTING]
        answers = await asyncio.gather(*(sup.probes.get(c, "/readyz", sup.settings.liveness_timeout_s)
                                         for c in starting))
        for c, r in zip(starting, answers):
            sup.put("ready_probe", c, r)
        sup.put("startup_deadline")
