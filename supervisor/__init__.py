"""onecard's supervisor: starts every service of the unit, watches them, and exits as soon
as any of them dies or hangs, so that the orchestrator restarts the whole unit.

The way through the code, from the outside in (each package may import only those below it;
pyproject.toml's import-linter contracts check it):

- `cli/`: the command line (`onecard run | check | status | stop`) and the lean process
  that `run` hands over to;
- `driver/`: the one loop that turns what happens into events for the policy and carries
  out what it says, and its helpers (probes, logs, samples, containment, MPS, endpoints);
- `servers/`: the control socket and the probe port, which know nothing of the driver;
- `system/`: the OS layer: every system call (processes, signals, cgroups, ports, the
  process table, NVML, the MPS control binary, the real clock);
- `policy/`: the rules, pure: the lifecycle tables, the exit codes, what each signal
  means, and the plan (what will be started, from the config and the host's facts);
- `config/`: what the operator writes, read and checked once.

docs/supervisor.md has the same map with the file that holds each rule.
"""
