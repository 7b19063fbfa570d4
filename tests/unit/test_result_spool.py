"""ResultSpool on the real filesystem: results as files in a private directory, a full disk
(a real tmpfs of 64 KiB) keeps a result in memory instead, a dead owner's directory is
removed by the next one and a live owner's is not."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from services.jobs.result_spool import LOCK, PREFIX, ResultSpool
from tests.harness import ROOT


def test_results_are_files_read_in_pieces_and_removed(tmp_path):
    async def main():
        spool = ResultSpool(str(tmp_path))
        data = os.urandom(300_000)
        await spool.put("a" * 32, data)
        assert spool.in_memory == {} and spool.size("a" * 32) == len(data)
        (path,) = [p for p in os.listdir(spool.dir) if p != LOCK]
        assert open(os.path.join(spool.dir, path), "rb").read() == data
        assert await spool.chunk("a" * 32, 1000, 5000) == data[1000:6000]
        await spool.put("a" * 32, b"again")  # replaced: the old file goes
        assert await spool.chunk("a" * 32, 0, 100) == b"again"
        spool.drop("a" * 32)
        assert await spool.chunk("a" * 32, 0, 10) == b"" and spool.size("a" * 32) is None
        await asyncio.sleep(0.1)
        assert os.listdir(spool.dir) == [LOCK]
        spool.close()
        assert not os.path.exists(spool.dir)
    asyncio.run(main())


def test_an_empty_directory_setting_keeps_results_in_memory():
    async def main():
        spool = ResultSpool("")
        await spool.put("b" * 32, b"xyz")
        assert spool.dir is None and spool.in_memory == {"b" * 32: b"xyz"}
        assert await spool.chunk("b" * 32, 1, 5) == b"yz"
    asyncio.run(main())


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_keeps_the_result_in_memory_with_one_warning(tiny_disk, caplog):
    async def main():
        spool = ResultSpool(str(tiny_disk))
        assert spool.dir is not None and spool.dir.startswith(str(tiny_disk))
        big = os.urandom(200_000)  # over the disk's 64 KiB
        with caplog.at_level(logging.WARNING, logger="onecard.jobs"):
            await spool.put("c" * 32, big)
            await spool.put("d" * 32, big)
        assert spool.in_memory.keys() == {"c" * 32, "d" * 32}
        assert await spool.chunk("c" * 32, 0, len(big)) == big
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 and len(caplog.records) == 1
        assert "kept in memory" in caplog.records[0].message
        assert os.listdir(spool.dir) == [LOCK]  # the part written was removed
        await spool.put("e" * 32, b"small")  # room again for a small one: on disk
        assert "e" * 32 not in spool.in_memory
        spool.close()
    asyncio.run(main())


def test_results_kept_in_memory_move_to_the_disk_once_it_has_room(tiny_disk):
    """helper-54: a full disk kept 49 results (300 MiB) in the jobs service's memory until their
    hour was up, though older results removed had made room."""
    async def main():
        spool = ResultSpool(str(tiny_disk))
        first, second, third = os.urandom(40_000), os.urandom(40_000), os.urandom(9_000)
        await spool.put("a" * 32, first)
        await spool.put("b" * 32, second)  # the disk (64 KiB) holds one of them
        assert spool.in_memory.keys() == {"b" * 32}
        spool.drop("a" * 32)  # its file removed: room for the one in memory
        for _ in range(100):
            if not spool.in_memory:
                break
            await asyncio.sleep(0.02)
        assert not spool.in_memory and "b" * 32 in spool.files
        assert await spool.chunk("b" * 32, 0, 40_000) == second and spool.size("b" * 32) == 40_000
        await spool.put("c" * 32, os.urandom(40_000))  # full again: in memory
        await spool.put("d" * 32, third)  # a later write that fits moves nothing it cannot
        assert spool.in_memory.keys() == {"c" * 32} and "d" * 32 in spool.files
        spool.close()
    asyncio.run(main())


OWNER = ("import asyncio, sys, time\n"
         "from services.jobs.result_spool import ResultSpool\n"
         "spool = ResultSpool(sys.argv[1])\n"
         "asyncio.run(spool.put('f' * 32, b'x' * 1000))\n"
         "print(spool.dir, flush=True)\n"
         "time.sleep(60)\n")


def _owner(parent) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(parent)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return proc, proc.stdout.readline().strip()


def test_a_dead_owners_directory_is_removed_and_a_live_ones_is_not(tmp_path):
    live, live_dir = _owner(tmp_path)
    dead, dead_dir = _owner(tmp_path)
    try:
        assert os.path.isdir(live_dir) and os.path.isdir(dead_dir)
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        (tmp_path / f"{PREFIX}being-made").mkdir()  # no lock yet, just made: left alone
        spool = ResultSpool(str(tmp_path))
        assert not os.path.exists(dead_dir)
        assert os.path.isdir(live_dir) and len(os.listdir(live_dir)) == 2  # its lock and its result
        assert (tmp_path / f"{PREFIX}being-made").is_dir()
        spool.close()
    finally:
        for proc in (live, dead):
            proc.kill()
            proc.wait(10)


def test_a_directory_that_cannot_be_made_keeps_results_in_memory(tmp_path, caplog):
    target = tmp_path / "not-a-directory"
    target.write_text("")

    async def main():
        with caplog.at_level(logging.WARNING, logger="onecard.jobs"):
            spool = ResultSpool(str(target))
        assert spool.dir is None and "kept in memory" in caplog.text
        await spool.put("g" * 32, b"kept")
        assert spool.in_memory == {"g" * 32: b"kept"}
    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 5
