"""A scripted OS layer (supervisor/system/os_layer.py's methods): a process table whose
children die when told, signals recorded, reaping, and what each service started beside
its main process (its containment). No real process.

Each faked behaviour has its integration twin against real processes:
tests/integration/test_lifecycle.py, test_containment.py, test_signals.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from supervisor.system.containment import Leftover
from supervisor.system.os_layer import Spawned


class FakeContainment:
    """What each service started beside its main process (`ScriptedOs.descendants`):
    SIGTERM ends those not in `stubborn_descendants`, SIGKILL those not `unkillable`."""

    kind = "fake"

    def __init__(self, fake: ScriptedOs):
        self.fake = fake
        self.released = False

    def describe(self):
        return "fake containment"

    def join_path(self, name):
        return f"/fake/{name}/cgroup.procs"

    def members(self, name, root):
        return set(self.fake.descendants.get(name, ()))

    def send(self, name, root, sig, skip_group=None):
        self.fake.member_signals.append((name, sig))
        if sig == signal.SIGTERM:
            self.fake.descendants[name] = {p for p in self.fake.descendants.get(name, ())
                                           if p in self.fake.stubborn_descendants}
        return set()

    def kill(self, name, root):
        self.fake.member_signals.append((name, signal.SIGKILL))
        self.fake.descendants[name] = {p for p in self.fake.descendants.get(name, ()) if p in self.fake.unkillable}
        return set(self.fake.descendants[name])

    def release(self):
        self.released = True

    def spec(self):
        return {}


class ScriptedOs:
    """A process table: children die when told; `stubborn` ones ignore SIGTERM."""

    def __init__(self, stubborn=()):
        self.next_pid = 1000
        self.names: dict[int, str] = {}
        self.by_name: dict[str, int] = {}
        self.tokens: dict[int, str] = {}   # port -> instance token of the spawn
        self.stubborn = set(stubborn)
        self.exits: list[tuple[int, int]] = []
        self.signals: list[tuple[str, int]] = []     # every group signal sent
        self.delivered: list[tuple[str, int]] = []   # those that reached a live child
        self.write_ends: dict[int, int] = {}
        self.spawned: list[str] = []
        self.joins: dict[str, str | None] = {}       # service -> the cgroup it joined
        self.envs: dict[str, dict] = {}
        self.fail_spawn: set[str] = set()
        self.descendants: dict[str, set[int]] = {}   # what each service started, beside its main
        self.stubborn_descendants: set[int] = set()
        self.unkillable: set[int] = set()
        self.member_signals: list[tuple[str, int]] = []
        self.left_behind: list[Leftover] = []        # what an earlier run left (found at start)
        self.ended: list[int] = []
        self.orphans_alive: set[int] = set()         # adopted orphans still running
        self.held: list[str] = []                    # "release"/"hold" of the stop signals, in order
        self.containment_obj = FakeContainment(self)
        self.sup: Any = None                         # the supervisor it serves (told of SIGCHLD)

    def getpid(self):
        return 1

    def become_subreaper(self):
        return True

    def raise_open_files_limit(self):
        pass

    def release_signals(self, sigs):
        self.held.append("release")

    def hold_signals(self, sigs):
        self.held.append("hold")

    def containment(self, marker, names, mode):
        return self.containment_obj

    def leftovers(self, marker):
        return list(self.left_behind), []

    def end_leftovers(self, marker, found, dirs):
        self.ended += [x.pid for x in found]
        self.left_behind = []
        return set()

    def own_children(self):
        return set(self.orphans_alive) | set(self.write_ends)

    def start_sentinel(self, spec):
        return None, None

    def write(self, fd, data):
        pass

    def spawn(self, argv, env, stdin_data=None, join=None):
        name = env["ONECARD_SERVICE_NAME"]
        if name in self.fail_spawn:
            raise FileNotFoundError(2, "No such file or directory")
        self.next_pid += 1
        pid = self.next_pid
        self.names[pid], self.by_name[name] = name, pid
        self.tokens[int(env["ONECARD_SERVICE_PORT"])] = env["ONECARD_INSTANCE_TOKEN"]
        self.spawned.append(name)
        self.joins[name] = join
        self.envs[name] = env
        r, w = os.pipe()
        os.write(w, f"hello from {name}\n".encode())
        self.write_ends[pid] = w
        return Spawned(pid, r)

    def die(self, name_or_pid, status):
        pid = self.by_name.get(name_or_pid, name_or_pid)
        self.exits.append((pid, status))
        if pid in self.write_ends:
            os.close(self.write_ends.pop(pid))
        self.sup.handle_sigchld()

    def kill_group(self, pgid, sig):
        name = self.names[pgid]
        self.signals.append((name, sig))
        alive = pgid in self.write_ends
        if alive:
            self.delivered.append((name, sig))
        if alive and (sig == signal.SIGKILL or (sig == signal.SIGTERM and name not in self.stubborn)):
            status = sig if sig == signal.SIGKILL else 0  # raw wait status: killed by N, or exit 0
            asyncio.get_running_loop().call_soon(self.die, pgid, status)
        return alive

    def kill(self, pid, sig):
        if pid in self.orphans_alive:
            if sig == signal.SIGKILL and pid not in self.unkillable:
                self.orphans_alive.discard(pid)
            return True
        return self.kill_group(pid, sig)

    def reap(self):
        out, self.exits = self.exits, []
        return out

    def close(self, fd):
        pass
