"""Containment: every process a service starts stays findable, and ends with the unit.

A service may start processes that leave its process group and session (a daemonizing
server, a `sh start.sh` wrapper whose server calls setsid()); signalling the group misses
them, and PR_SET_PDEATHSIG covers only the direct child. So, as systemd and s6 do, each
service runs in a container of its own, the best one this machine allows (`supervisor.
containment`, "auto" tries them in this order):

- ``cgroup2``: a cgroup per service under the supervisor's own cgroup in the v2 hierarchy
  (a pure or a hybrid mount); ``cgroup.kill`` ends the whole subtree at once (Linux 5.14+;
  older kernels: freeze, SIGKILL every member, thaw). Limits set on the supervisor's cgroup
  still hold: the service's cgroup is below it.
- ``cgroup1``: the same in the v1 freezer hierarchy (freeze, SIGKILL, thaw: nothing can fork
  past the kill), else the v1 pids hierarchy (SIGKILL until empty). Other v1 hierarchies
  (memory, cpu) are left as they are, so a memory limit on the unit still applies.
- ``process``: no cgroup can be made (an unprivileged container): the service's process
  tree plus every process whose environment carries this run's marker, which covers
  descendants that the subreaper adopted.

Every process a service starts carries the unit's marker in its environment
(``ONECARD_UNIT_ID``: the same for every run on the same control socket; ``ONECARD_RUN_ID``:
new at each start), so what a SIGKILLed supervisor left behind is provably ours at the next
start, whatever its cgroup: never "whatever holds the port".

Standard library only, and synchronous: the driver calls this in worker threads, and the
sentinel (sentinel.py) imports it in a bare interpreter after the supervisor is gone.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.system.proctable import RUN_VAR, UNIT_VAR, alive, cmdline, environ, kill_each, marked, read_file, tree

MODES = ("auto", "cgroup2", "cgroup1", "process")
KILL_ROUNDS = 50            # SIGKILL passes before giving up on a subtree
KILL_PAUSE_S = 0.02
FREEZE_WAIT_S = 1.0


def unit_key(control_socket: str) -> str:
    """The unit's identity on this machine: one supervisor at a time holds a control socket."""
    return hashlib.sha256(os.path.abspath(control_socket).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Marker:
    unit: str
    run: str

    def env(self) -> dict[str, str]:
        return {UNIT_VAR: self.unit, RUN_VAR: self.run}


def new_run_id() -> str:
    """This supervisor's pid and start time: unique, and tells whether that run's
    supervisor is still alive (run_alive)."""
    return f"{os.getpid()}.{_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    stat = read_file(f"/proc/{pid}/stat") or ""
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else "0"  # field 22 of stat: start time in clock ticks


def run_alive(run: str) -> bool:
    """The supervisor of that run still runs (here: same pid namespace, same boot)."""
    pid, _, started = run.partition(".")
    return pid.isdigit() and alive(int(pid)) and _start_time(int(pid)) == started


# ---- cgroup hierarchies -----------------------------------------------------------------
def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    out = []
    for line in (read_file("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((point, rfields[0], set(rfields[2].split(","))))
    return out


def _own_path(controller: str | None) -> str:
    """This process's cgroup in the v2 hierarchy (None) or in a v1 one (its controller)."""
    for line in (read_file("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if controller is None and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if controller is not None and controller in parts[1].split(","):
            return parts[2]
    return "/"


def hierarchy_base(kind: str) -> tuple[Path, str] | None:
    """Where a unit's cgroups go: (the supervisor's own cgroup dir, the v1 controller or '')."""
    mounts = _mounts()
    wanted = [("cgroup2", "")] if kind == "cgroup2" else [("cgroup", "freezer"), ("cgroup", "pids")]
    for fstype, controller in wanted:
        for point, found_type, opts in mounts:
            if found_type != fstype or (controller and controller not in opts):
                continue
            own = _own_path(controller or None).strip("/")
            base = Path(point) / own if own else Path(point)
            if not base.is_dir():  # a cgroup namespace: its root is our own cgroup
                base = Path(point)
            return base, controller
    return None


def _procs(d: Path) -> set[int]:
    out: set[int] = set()
    for sub, _, _ in os.walk(d):
        text = read_file(os.path.join(sub, "cgroup.procs"))
        if text:
            out.update(int(x) for x in text.split())
    return out


def _write(path: Path, text: str) -> bool:
    try:
        with open(path, "w") as fh:
            fh.write(text)
        return True
    except OSError:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def kill_cgroup(d: Path, kind: str) -> set[int]:
    """SIGKILL everything in a cgroup subtree; the processes still there afterwards."""
    if not d.is_dir():
        return set()
    if kind == "cgroup2" and (d / "cgroup.kill").exists() and _write(d / "cgroup.kill", "1"):
        return _wait_empty(d)
    freeze = _freezer(d, kind)
    for _ in range(KILL_ROUNDS):
        pids = _procs(d)
        if not pids:
            return set()
        if freeze:
            freeze(True)
        kill_each(pids, signal.SIGKILL)
        if freeze:
            freeze(False)
        time.sleep(KILL_PAUSE_S)
    return _procs(d)


def _freezer(d: Path, kind: str):
    """A function that freezes/thaws the subtree (so nothing forks past a kill), or None."""
    if kind == "cgroup2" and (d / "cgroup.freeze").exists():
        def freeze(on: bool) -> None:
            _write(d / "cgroup.freeze", "1" if on else "0")
            _settle(lambda: ("frozen 1" in (read_file(str(d / "cgroup.events")) or "")) == on)
        return freeze
    if kind == "cgroup1" and (d / "freezer.state").exists():
        def freeze(on: bool) -> None:
            _write(d / "freezer.state", "FROZEN" if on else "THAWED")
            want = "FROZEN" if on else "THAWED"
            _settle(lambda: (read_file(str(d / "freezer.state")) or "").strip() == want)
        return freeze
    return None


def _settle(done, limit_s: float = FREEZE_WAIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.002)


def _wait_empty(d: Path, limit_s: float = 2.0) -> set[int]:
    deadline = time.monotonic() + limit_s
    while True:
        left = _procs(d)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.005)


def remove_tree(d: Path) -> None:
    """rmdir a cgroup subtree, deepest first (a cgroup with processes stays)."""
    if not d.is_dir():
        return
    for sub, _, _ in os.walk(d, topdown=False):
        try:
            os.rmdir(sub)
        except OSError:
            pass


# ---- one unit's containment -------------------------------------------------------------
class Containment:
    """Process mode: the service's tree plus what carries the run's marker."""

    kind = "process"

    def __init__(self, marker: Marker):
        self.marker = marker
        self.note = ""

    def describe(self) -> str:
        return "process (tree and environment marker; no cgroup could be made" + (
            f": {self.note})" if self.note else ")")

    def join_path(self, name: str) -> str | None:
        """The cgroup.procs file a new child of service `name` writes itself into."""
        return None

    def members(self, name: str, root: int | None) -> set[int]:
        return tree(root) | marked(self.marker.unit, run=self.marker.run, service=name)

    def send(self, name: str, root: int | None, sig: int, skip_group: int | None = None) -> set[int]:
        """Signal every member, except those in process group `skip_group` (the driver
        signals the main's group itself: one SIGTERM each, not two)."""
        pids = self.members(name, root)
        if skip_group is not None:
            pids = {p for p in pids if _pgid(p) != skip_group}
        sent = kill_each(pids, sig)
        if sig == signal.SIGTERM:  # a stopped (SIGSTOP) process acts on it only once it runs again
            kill_each(sent, signal.SIGCONT)
        return sent

    def kill(self, name: str, root: int | None) -> set[int]:
        for _ in range(KILL_ROUNDS):
            pids = self.members(name, root)
            if not pids:
                return set()
            kill_each(pids, signal.SIGKILL)
            time.sleep(KILL_PAUSE_S)
        return self.members(name, root)

    def release(self) -> None:
        pass

    def spec(self) -> dict:
        """What the sentinel needs to end this run after the supervisor is gone."""
        return {"unit": self.marker.unit, "run": self.marker.run, "kind": self.kind, "dirs": []}


class CgroupContainment(Containment):
    def __init__(self, marker: Marker, kind: str, base: Path, controller: str):
        super().__init__(marker)
        self.kind = kind
        self.controller = controller
        self.unit_dir = base / f"onecard.{marker.unit}"
        self.run_dir = self.unit_dir / marker.run

    def describe(self) -> str:
        how = {"": "cgroup.kill" if (self.run_dir / "cgroup.kill").exists() else "freeze and kill",
               "freezer": "freeze and kill", "pids": "kill until empty"}[self.controller]
        return f"{self.kind}{f' ({self.controller})' if self.controller else ''} at {self.run_dir} ({how})"

    def create(self, names: list[str]) -> None:
        for d in [self.unit_dir, self.run_dir] + [self.run_dir / n for n in names]:
            d.mkdir(exist_ok=True)

    def join_path(self, name: str) -> str | None:
        return str(self.run_dir / name / "cgroup.procs")

    def join_problem(self, names: list[str]) -> str | None:
        """Why a child could not move itself into its cgroup: a process may move between
        cgroups only with write access to both and (v2) to their common ancestor's procs."""
        for path in [self.join_path(n) for n in names] + [str(self.unit_dir.parent / "cgroup.procs")]:
            if path and not os.access(path, os.W_OK):
                return f"{path} is not writable (no delegation)"
        return None

    def members(self, name: str, root: int | None) -> set[int]:
        return _procs(self.run_dir / name)

    def kill(self, name: str, root: int | None) -> set[int]:
        return kill_cgroup(self.run_dir / name, self.kind)

    def release(self) -> None:
        remove_tree(self.run_dir)
        _rmdir(self.unit_dir)  # only when no other run's cgroup is left in it

    def spec(self) -> dict:
        return {**super().spec(), "dirs": [str(self.run_dir)]}


def create(marker: Marker, names: list[str], mode: str = "auto") -> Containment:
    """The best containment that works here (`mode` names one; a failure falls back)."""
    notes = []
    kinds = ("cgroup2", "cgroup1") if mode == "auto" else (mode,) if mode != "process" else ()
    for kind in kinds:
        found = hierarchy_base(kind)
        if found is None:
            notes.append(f"{kind}: no hierarchy mounted")
            continue
        c = CgroupContainment(marker, kind, *found)
        try:
            c.create(names)
        except OSError as exc:
            notes.append(f"{kind}: cannot create {c.run_dir}: {exc.strerror or exc}")
            c.release()
            continue
        problem = c.join_problem(names)
        if problem:
            notes.append(f"{kind}: {problem}")
            c.release()
            continue
        return c
    out = Containment(marker)
    out.note = "; ".join(notes)
    return out


# ---- what an earlier run left behind ----------------------------------------------------
@dataclass(frozen=True)
class Leftover:
    pid: int
    what: str   # its command line
    where: str  # how we know it is ours


def leftovers(marker: Marker) -> tuple[list[Leftover], list[tuple[Path, str]]]:
    """Processes of earlier runs of this unit (its cgroups, its environment marker), and
    those runs' cgroup directories."""
    found: dict[int, Leftover] = {}
    dirs = []
    for kind in ("cgroup2", "cgroup1"):
        base = hierarchy_base(kind)
        if base is None:
            continue
        unit_dir = base[0] / f"onecard.{marker.unit}"
        try:
            runs = [d for d in unit_dir.iterdir() if d.is_dir() and d.name != marker.run and not run_alive(d.name)]
        except OSError:
            continue
        for d in runs:
            dirs.append((d, kind))
            for pid in _procs(d):
                found.setdefault(pid, Leftover(pid, cmdline(pid), f"cgroup {d}"))
    for pid in marked(marker.unit, not_run=marker.run):
        if not run_alive(environ(pid).get(RUN_VAR, "")):  # never a live supervisor's process
            found.setdefault(pid, Leftover(pid, cmdline(pid), f"environment {UNIT_VAR}={marker.unit}"))
    return sorted(found.values(), key=lambda x: x.pid), dirs


def end_leftovers(marker: Marker, found: list[Leftover], dirs: list[tuple[Path, str]]) -> set[int]:
    """SIGKILL what an earlier run left; the pids still alive afterwards."""
    for d, kind in dirs:
        kill_cgroup(d, kind)
    pids = {x.pid for x in found}
    for _ in range(KILL_ROUNDS):
        pids = {p for p in pids if alive(p)} | {p for p in marked(marker.unit, not_run=marker.run)
                                                 if not run_alive(environ(p).get(RUN_VAR, ""))}
        if not pids:
            break
        kill_each(pids, signal.SIGKILL)
        time.sleep(KILL_PAUSE_S)
    for d, _ in dirs:
        remove_tree(d)
    return {p for p in pids if alive(p)}


def _rmdir(d: Path) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass


def end_run(spec: dict) -> set[int]:
    """Everything of one run, ended (the sentinel, after a supervisor died)."""
    for d in spec.get("dirs", []):
        kill_cgroup(Path(d), spec["kind"])
    left: set[int] = set()
    for _ in range(KILL_ROUNDS):
        left = marked(spec["unit"], run=spec["run"])
        if not left:
            break
        kill_each(left, signal.SIGKILL)
        time.sleep(KILL_PAUSE_S)
    for d in spec.get("dirs", []):
        remove_tree(Path(d))
        _rmdir(Path(d).parent)  # the unit's directory, when no other run is in it
    return left
