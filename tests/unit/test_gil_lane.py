"""Work that keeps the GIL (JSON, base64, multipart) takes turns in one lane, in short slices,
and big JSON bodies reach json.loads without their base64 strings: the event loop competes
with one such thread at a time, for a fraction of a millisecond each (services.runtime.
codecs.gil_lane, json_big_strings, fresh_bytes)."""

from __future__ import annotations

import base64
import binascii
import json
import os
import sys
import threading
import time
import weakref

import pytest

from services.runtime.codecs import json_big_strings
from services.runtime.codecs.base64_text import decode_base64, encode_base64
from services.runtime.codecs.forms import parse_json, parse_multipart
from services.runtime.codecs.fresh_bytes import FreshAscii, FreshBytes
from services.runtime.codecs.gil_lane import lane
from services.runtime.codecs.json_big_strings import is_ascii
from services.runtime.errors import ApiError
from services.runtime.pipeline.cpu_pool import CpuPool

BIG = base64.b64encode(os.urandom(400_000)).decode()


def _finishes_only_after_the_lane_is_free(work) -> bool:
    done = threading.Event()
    th = threading.Thread(target=lambda: (work(), done.set()))
    with lane():
        th.start()
        held_back = not done.wait(0.5)
    th.join(10)
    return held_back and done.is_set()


@pytest.mark.parametrize("step", ["json", "multipart"])
def test_big_gil_bound_steps_wait_for_the_lane(step):
    doc = json.dumps({"image": "x" + BIG[1:] + "\\n", "n": 1}).encode()  # an escape: all of it goes to json.loads
    form = b"--b\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n" + BIG.encode() + b"\r\n--b--\r\n"
    work = {"json": lambda: parse_json(doc, 16),
            "multipart": lambda: parse_multipart(form, "multipart/form-data; boundary=b", 4)}[step]
    assert _finishes_only_after_the_lane_is_free(work)


def _other_threads_ran_during(work, tries: int = 3) -> bool:
    """Whether another thread ran while `work` ran, with forced GIL switches turned off (a 10 s
    interval): it can then only run while `work` has released the GIL. Work that keeps the
    GIL throughout never lets it; the other thread may also just not be scheduled in the
    few milliseconds the work takes on a busy machine, hence a few tries."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(10)
    try:
        for _ in range(tries):
            span, stamps, done = [], [], threading.Event()

            def run(span=span, done=done):
                t0 = time.perf_counter()
                work()
                span.extend((t0, time.perf_counter()))
                done.set()

            th = threading.Thread(target=run)
            th.start()
            while not done.is_set():
                stamps.append(time.perf_counter())
                time.sleep(0.0001)
            th.join()
            if any(span[0] < t < span[1] for t in stamps):
                return True
        return False
    finally:
        sys.setswitchinterval(before)


HUGE = 48 << 20   # big enough that even libbase64 takes a few milliseconds on it


@pytest.mark.parametrize("step", ["base64 in", "base64 in, data: URL", "base64 out", "fresh bytes copy",
                                  "ASCII check"])
def test_base64_and_big_copies_release_the_gil(step):
    raw = os.urandom(HUGE)
    text = base64.b64encode(raw).decode()
    body = text.encode()
    work = {"base64 in": lambda: decode_base64(text, "image"),
            "base64 in, data: URL": lambda: decode_base64("data:image/png;base64," + text, "image"),
            "base64 out": lambda: encode_base64(raw),
            "fresh bytes copy": lambda: FreshBytes(len(raw)).write(raw),
            "ASCII check": lambda: [is_ascii(body) for _ in range(8)]}[step]  # (one is 2 ms: too short to see)
    assert _other_threads_ran_during(work)


def test_the_ascii_check_says_what_bytes_isascii_says():
    for data in (b"", b"a", b"\x7f" * 5, b"\x80", b"plain text" * 1000 + b"\xff", bytes(range(128)),
                 "caf\u00e9".encode(), os.urandom(4096)):
        assert is_ascii(data) == data.isascii(), data[:20]


def test_the_gil_check_sees_work_that_keeps_the_gil():
    text = base64.b64encode(os.urandom(HUGE // 4)).decode()
    assert not _other_threads_ran_during(lambda: binascii.a2b_base64(text, strict_mode=True), tries=1)


def test_small_work_does_not_wait_for_the_lane():
    done = threading.Event()
    with lane():
        th = threading.Thread(target=lambda: (parse_json(b'{"a": [1, 2]}', 16), decode_base64("aGk=", "x"),
                                              done.set()))
        th.start()
        assert done.wait(5)
    th.join()


DOCS = [
    {"image": BIG, "steps": 2, "prompt": 'a "quoted" \\ prompt\n'},
    {"init_images": [BIG, "data:image/png;base64," + BIG, BIG], "x": {"y": [BIG], "z": []}},
    [BIG, 1, 2.5, None, True, "", {}],
    BIG,
    {BIG: 1, "v": BIG},                       # a big key stays in the document
    {"image": BIG + "\\/"},                   # escapes: json.loads reads it
    {'esc\\"': BIG, "k": "\\\\", "z": BIG},
    {"image": BIG[:-8] + "!!!!!!!!"},         # not base64
    {"image": "data:" + BIG},                 # a data: prefix without its comma
    {"image": "ünïcode " + BIG},
    {"a": BIG + "\\" * 50},                   # an even run of backslashes before the closing quote
]


@pytest.mark.parametrize("doc", DOCS, ids=range(len(DOCS)))
def test_a_document_parses_as_json_loads_parses_it(doc):
    raw = json.dumps(doc, ensure_ascii=False).encode()
    assert json_big_strings.loads(raw) == json.loads(raw)
    assert parse_json(raw, 16) == json.loads(raw)
    php = raw.replace(b"/", b"\\/")           # PHP escapes every slash
    assert json_big_strings.loads(php) == json.loads(php)


@pytest.mark.parametrize("bom", [b"", b"\xff\xfe"])
def test_a_utf16_document_is_read_as_json_loads_reads_it(bom):
    # json.loads reads UTF-16 too: here the bytes '"', 'A' * 80 002, '"' are halves of CJK
    # characters (U+4122, U+4141..., U+2241), not a base64 string to cut out
    text = "\u2200\u4122" + "\u4141" * 40_000 + "\u2241\u2200"
    raw = bom + json.dumps({"k": text}, ensure_ascii=False).encode("utf-16-le")
    assert b'"' + b"A" * 80_002 + b'"' in raw
    assert json.loads(raw) == {"k": text}
    assert json_big_strings.loads(raw) == {"k": text}
    assert parse_json(raw, 16) == {"k": text}


def test_megabytes_of_whitespace_around_a_big_string_cost_no_python_loop():
    import time
    raw = b'{"a": "' + BIG.encode() + b'"' + b" " * 15_000_000 + b', "k"' + b"\n" * 5_000_000 + b': 1}'
    t0 = time.process_time()
    assert json_big_strings.loads(raw) == {"a": BIG, "k": 1}
    # CPU seconds, not wall: 0.05 here; a byte-by-byte Python loop over the 15 MB took 2 s
    assert time.process_time() - t0 < 1.0


def test_json_loads_sees_only_the_document_around_the_pictures():
    raw = json.dumps({"init_images": [BIG, "data:image/jpeg;base64," + BIG], "prompt": "a cat", "steps": 20}).encode()
    skeleton, texts = json_big_strings.split_big_strings(raw, 100)
    assert len(raw) > 1_000_000 and len(skeleton) < 300
    assert sorted(map(len, texts.values())) == [len(BIG), len(BIG) + 23]


def test_a_json_body_reaches_json_loads_without_its_pictures(monkeypatch):
    seen: list[int] = []
    real = json.loads
    monkeypatch.setattr(json_big_strings.json, "loads",
                        lambda data, **kw: (seen.append(len(data)), real(data, **kw))[1])
    doc = parse_json(json.dumps({"init_images": [BIG, BIG], "prompt": "a cat"}).encode(), 16)
    assert doc["init_images"] == [BIG, BIG] and seen and max(seen) < 300


@pytest.mark.parametrize("raw", [
    b'{"a": "' + BIG.encode() + b'"',                      # unterminated
    b'{"a": "' + BIG.encode() + b'\x01"}',                 # a control character inside a big string
    b'"' * 200_001,                                        # quotes and nothing else
    b'{"a": "' + BIG.encode() + b'"} trailing',
    b'{"a": "' + BIG.encode() + b'\\' * 101 + b'"}',        # a long run of backslashes: json.loads decides
])
def test_what_json_loads_refuses_is_refused(raw):
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(ValueError):
        json_big_strings.loads(raw)
    with pytest.raises(ApiError) as err:
        parse_json(raw, 16)
    assert err.value.status == 400


def test_a_multipart_part_over_many_slices_comes_back_whole():
    data = os.urandom(3_500_000)
    form = (b"--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + data + b"\r\n--b\r\nContent-Disposition: form-data; "
            b"name=\"t\"\r\n\r\nhi\r\n--b\r\nContent-Disposition: form-data; name=\"e\"\r\n\r\n\r\n--b--\r\n")
    parts = parse_multipart(form, "multipart/form-data; boundary=b", 8)
    assert type(parts["image"].data) is bytes and parts["image"].data == data
    assert (parts["t"].data, parts["e"].data, parts["image"].filename) == (b"hi", b"", "a.png")


@pytest.mark.parametrize("kind", [FreshBytes, FreshAscii])
def test_a_fresh_object_is_handed_out_only_whole(kind):
    out = kind(10)
    out.write(b"abcd")
    with pytest.raises(ValueError):
        out.take()
    with pytest.raises(ValueError):
        out.write(b"0123456789")
    out.write(b"efghij")
    got = out.take()
    expected = b"abcdefghij" if kind is FreshBytes else "abcdefghij"
    assert type(got) is type(expected) and got == expected and hash(got) == hash(expected)
    with pytest.raises(ValueError):
        out.take()


def test_a_view_of_what_was_written_outlives_the_object_safely():
    # in a child process: a view into a freed object reads freed memory (it crashed)
    import subprocess
    code = """if True:
        import gc
        from services.runtime.codecs.fresh_bytes import FreshBytes
        out = FreshBytes(1 << 20)
        out.write(b"x" * (1 << 20))
        seen = out.written()
        try:
            seen[0] = 0
        except TypeError:
            pass
        else:
            raise SystemExit("the view is writable: the bytes handed out could change")
        got = out.take()
        del out, got
        gc.collect()
        junk = [bytes(range(256)) * 4096 for _ in range(8)]
        assert bytes(seen[:4]) == b"xxxx"
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_released_objects_are_freed_on_a_pool_thread():
    freed_on: list[str] = []

    class Big:
        pass
    pool = CpuPool(2)
    try:
        obj = Big()
        weakref.finalize(obj, lambda: freed_on.append(threading.current_thread().name))
        garbage = [obj]
        del obj
        pool.release(garbage)
        del garbage
        for _ in range(100):
            if freed_on:
                break
            threading.Event().wait(0.02)
    finally:
        pool.shutdown()
    assert freed_on and freed_on[0].startswith("onecard-cpu")


def test_the_service_process_shortens_the_gil_switch_interval():
    from services.runtime.shell.process import GIL_SWITCH_S, set_gil_switch_interval
    before = sys.getswitchinterval()
    try:
        assert set_gil_switch_interval({}) == GIL_SWITCH_S == sys.getswitchinterval() == 0.001
        assert set_gil_switch_interval({"ONECARD_GIL_SWITCH_MS": "2.5"}) == 0.0025
        assert set_gil_switch_interval({"ONECARD_GIL_SWITCH_MS": "nan"}) == GIL_SWITCH_S
    finally:
        sys.setswitchinterval(before)


def test_the_jobs_loop_never_waits_for_the_lane():
    """A submit of exactly the lane's threshold was parsed on the jobs event loop and took the
    lane there: the loop stood still while a worker held it."""
    import asyncio
    import concurrent.futures
    import types

    from services.jobs.service import JobsService
    from services.runtime.codecs.gil_lane import LANE_MIN_BYTES

    body = b'{"a": "' + b"x" * (LANE_MIN_BYTES - 9) + b'"}'
    assert len(body) == LANE_MIN_BYTES
    holding, release = threading.Event(), threading.Event()

    def hold_the_lane() -> None:
        with lane():
            holding.set()
            release.wait(2)            # let go on its own: never a hung test
    holder = threading.Thread(target=hold_the_lane)
    holder.start()
    holding.wait(5)
    executor = concurrent.futures.ThreadPoolExecutor(1)
    jobs = types.SimpleNamespace(executor=executor)

    async def main() -> tuple[bool, int]:
        ticks = 0

        async def beat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)
        beater = asyncio.create_task(beat())
        parse = asyncio.create_task(JobsService.cpu(jobs, len(body), parse_json, body, 4))
        await asyncio.sleep(0.2)
        parsed_while_held = parse.done()
        release.set()
        assert await parse == {"a": "x" * (LANE_MIN_BYTES - 9)}
        beater.cancel()
        return parsed_while_held, ticks
    try:
        parsed_while_held, ticks = asyncio.run(main())
    finally:
        release.set()
        holder.join()
        executor.shutdown()
    assert not parsed_while_held and ticks > 3


@pytest.mark.parametrize("slice_bytes", [1021, 4099, 64 * 1024 + 1])
def test_searches_made_a_slice_at_a_time_find_what_one_search_finds(monkeypatch, slice_bytes):
    """Quotes and backslashes are found a slice at a time (one search through a 20 MB string
    held the GIL for milliseconds): wherever the slices end, the document parses the same."""
    monkeypatch.setattr(json_big_strings, "FIND_SLICE", slice_bytes)
    for doc in DOCS:
        raw = json.dumps(doc, ensure_ascii=False).encode()
        assert json_big_strings.loads(raw) == json.loads(raw)


def test_joining_a_big_piece_takes_the_lane_a_slice_at_a_time(monkeypatch):
    """A 3 MB piece (an encoder's answer, a picture without its text chunks) is copied into the
    joined bytes at most COPY_SLICE_BYTES per turn in the lane: the lane's other users wait for
    a slice, not for the whole copy. The bytes come out as b"".join would give them."""
    from services.runtime.codecs import fresh_bytes
    turns, real = [], fresh_bytes.in_lane

    def counted(size, fn, piece):
        turns.append(memoryview(piece).nbytes)
        return real(size, fn, piece)

    monkeypatch.setattr(fresh_bytes, "in_lane", counted)
    big, small = bytes(range(256)) * (3 * 4096 + 17), b"tail"
    out = fresh_bytes.joined([big, memoryview(small)], len(big) + len(small))
    assert out == big + small
    assert turns == [fresh_bytes.COPY_SLICE_BYTES] * 3 + [len(big) - 3 * fresh_bytes.COPY_SLICE_BYTES, len(small)]
