"""The supervisor's rules, pure: no I/O, no clock, no asyncio, so that a test can replay any
history through them.

- `child_lifecycle`: a supervised child's states and events (CHILD_TABLE), what its death means;
- `unit_lifecycle`: the unit's states, events and actions (UNIT_TABLE), and its exit code;
- `exit_codes`, `signals`: what the unit's codes and the signals it gets mean;
- `plan`: what will be started, from a validated config and the host's facts (CPU quota,
  memory limit, environment).

May import: the standard library and `supervisor.config`. Never the OS layer (`system`),
the driver, the servers or the command line.
"""
