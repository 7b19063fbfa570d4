"""The driver: the one loop that turns OS events (reaped children, signals, probe answers,
timers) into events for the policy's tables, and carries out what they say.

- `supervisor`: the loop (`Supervisor`) and its dispatch table;
- `events`, `port`: the events it takes, and the narrow port its helpers reach it through;
- `reaper`: which exit belongs to whom; `child`: what we know of one supervised child;
- `service_watch`, `child_probe`: readiness and liveness probes, and whose answer it is;
- `descendants`: what the services start (containment, leftovers, the last sweep);
- `mps_child`: the MPS control daemon as a supervised child;
- `child_output`, `logs`: the children's pipes and the supervisor's own lines;
- `sampler`: CPU, memory and GPU figures from a worker thread;
- `endpoints`, `report`: what the control socket and the probe port answer.

May import: `supervisor.servers`, `supervisor.system`, `supervisor.policy`,
`supervisor.config.settings` and `common`. No pydantic, no typer, no ML library: the
long-running supervisor process is this package.
"""
