"""The OS layer: every system call the supervisor makes, so that the rest can be tested
against a fake of it (tests/fakes/).

- `os_layer`: processes (spawn, signal, reap), the signal mask, the subreaper, the
  containment and the sentinel, behind one class (`OsLayer`) the driver holds;
- `signal_mask`: which thread takes a signal, and when; `clock`: the real clock;
- `containment`, `proctable`, `sentinel`: cgroups, /proc and the process that outlives a
  SIGKILLed supervisor (standard library only: the sentinel runs in a bare interpreter);
- `process_tree`: a process's descendants and what they use (psutil);
- `ports`, `cpu_cgroup`, `nvml`, `mps_control`: port checks, the CPU quota and throttling,
  NVML's GPU facts, the MPS control daemon's binary, files and process.

Synchronous (the driver calls the slow parts in worker threads). May import: the standard
library, psutil, pynvml, `supervisor.policy` (its data types) and `supervisor.config`.
Never the driver, the servers or the command line.
"""
