"""Lean modules that both the supervisor and the services import.

Standard library only, and nothing from `supervisor` or `services` (an import-linter
contract in pyproject.toml checks it): the supervisor's long-running process and its
sentinel must stay light, and a service must not pull the supervisor in.

- `http1`: the small HTTP/1.1 pieces every probe speaks: read a request head within a
  byte limit and a deadline, answer in the JSON error envelope, the minimal GET client.
- `hostmemory`: cgroup and /proc memory facts (the unit's memory limit, a process's peak).
"""
