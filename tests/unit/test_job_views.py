"""GET /v1/jobs pages: finished jobs' views kept encoded (never stale: any field the view reads
makes a new key; bounded in bytes), the page the same bytes as one JSON encode of the whole,
and listings read and encoded a few at a time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.jobs.records import LIST_STATES, TERMINAL, public_view
from services.jobs.settings import JobsSettings
from services.jobs.views import KEPT_VIEW_BYTES, VIEW_FIELDS, EncodedViews


def job(i: int, state: str = "succeeded", **extra: str) -> dict[str, str]:
    fields = {"id": f"{i:032x}", "state": state, "service": "detect", "route": "/api/v1/facedetect",
              "model": "detect/haar/haar", "priority": "normal", "attempts": "1", "runs": "1", "progress": "0.5",
              "node": "unit-1", "error": "", "last_error": "", "dead": "", "cancel": "", "created_at": "1.5",
              "started_at": "2.5", "finished_at": "3.5", "retry_at": "", "entry": "7", "body_sha": "x" * 64}
    if state == "failed":
        fields["error"] = json.dumps({"code": "boom", "message": "échec ✓"})
    return {**fields, **extra}


def rendered(model, state, jobs, nxt) -> bytes:
    return JSONResponse({"model": model, "state": state, "jobs": [public_view(f) for f in jobs],
                         "next_cursor": nxt}).body


def test_a_page_is_the_bytes_of_one_encode_of_the_whole_kept_or_not():
    jobs = [job(i, state) for i, state in enumerate(list(LIST_STATES) * 3)]
    views = EncodedViews(2**20)
    for model, state, nxt in (("detect/haar/haar", None, None), ("m/é/✓", "failed", "3:17-ab"), ("m", "dead", "")):
        for _ in range(2):  # first encoded, then from what was kept
            assert views.page(model, state, jobs, nxt) == rendered(model, state, jobs, nxt)
    assert views.page("m", None, [], None) == rendered("m", None, [], None)
    assert len(views) == sum(1 for f in jobs if f["state"] in TERMINAL)  # running and queued ones change


def test_the_view_reads_no_field_that_is_not_part_of_the_key():
    class Reads(dict):
        seen: set[str] = set()

        def get(self, key, default=None):
            Reads.seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            Reads.seen.add(key)
            return super().__getitem__(key)

    for state in LIST_STATES:
        public_view(Reads(job(1, state, dead="1", cancel="1", retry_at="9.5")))
    assert Reads.seen <= set(VIEW_FIELDS), Reads.seen - set(VIEW_FIELDS)


@pytest.mark.parametrize("field", VIEW_FIELDS)
def test_a_kept_view_is_never_served_for_a_job_that_changed(field):
    views = EncodedViews(2**20)
    for state in sorted(TERMINAL):
        before = job(3, state)
        views.page("m", None, [before], None)
        value = {"state": "queued" if state != "queued" else "failed", "error": '{"code":"other"}',
                 "last_error": '{"code":"other"}', "dead": "1", "cancel": "1", "attempts": "9", "runs": "9"}
        after = {**before, field: value.get(field, before[field] + "1" if before[field] else "2.25")}
        assert views.page("m", None, [after], None) == rendered("m", None, [after], None), field


def test_kept_views_stay_within_their_bytes_and_the_oldest_go_first():
    views = EncodedViews(64 * 1024)
    jobs = [job(i, "cancelled") for i in range(2000)]
    for i in range(0, 2000, 100):
        views.page("m", None, jobs[i:i + 100], None)
        assert views.bytes <= 64 * 1024
    assert 0 < len(views) < 2000
    assert views.page("m", None, jobs[-3:], None) == rendered("m", None, jobs[-3:], None)
    kept_ids = {key[0] for key in views._views}
    assert f"{1999:032x}" in kept_ids and f"{0:032x}" not in kept_ids
    none = EncodedViews(0)
    assert none.page("m", None, jobs[:10], None) == rendered("m", None, jobs[:10], None) and len(none) == 0
    big = job(5, "failed", error=json.dumps({"code": "x", "message": "m" * KEPT_VIEW_BYTES}))
    assert views.page("m", None, [big], None) == rendered("m", None, [big], None)
    assert f"{5:032x}" not in {key[0] for key in views._views}


def test_listings_are_read_and_encoded_a_few_at_a_time_first_come_first_served():
    """16 listings at once: only max_listings_at_once of them read the broker (and encode)
    together; each of the others waits its turn and is answered in full."""
    from services.jobs import api_admin
    from services.jobs.service import JobsService

    state = {"now": 0, "most": 0, "order": []}

    class Broker:
        async def list_jobs(self, model, st, limit, cursor):
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["order"].append(model)
            await asyncio.sleep(0.01)
            state["now"] -= 1
            return [job(i, st) for i in range(limit)], None

    class Svc:
        broker = Broker()
        settings = JobsSettings.model_validate({"max_listings_at_once": 2})
        cpu = JobsService.cpu
        executor = None

    app = FastAPI()
    api_admin.add_admin_routes(app, Svc())

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            async def one(i: int) -> httpx.Response:
                await asyncio.sleep(i * 0.001)  # in this order
                return await client.get("/v1/jobs", params={"model": f"detect/haar/m{i}", "state": "succeeded",
                                                            "limit": 5})
            return await asyncio.gather(*(one(i) for i in range(16)))

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * 16
    assert all(len(r.json()["jobs"]) == 5 for r in answers)
    assert state["most"] == 2
    assert state["order"] == [f"detect/haar/m{i}" for i in range(16)]


@pytest.mark.parametrize("extra", [
    {"state": "failed", "error": '{"code": "boom", "message": "x", "score": NaN}'},
    {"state": "failed", "error": '{"code": "boom", "message": "bad \\ud800 text", "\\udfff": -Infinity}'},
    {"state": "running", "progress": "nan", "last_error": '[Infinity, {"m": "\\udbff"}]'},
    {"state": "succeeded", "created_at": "inf", "finished_at": "-inf", "started_at": "nan"},
    {"state": "failed", "error": "[" * 100_000 + "]" * 100_000},  # deeper than json.loads goes
    {"state": "failed", "attempts": "1.0", "runs": "many"},  # a record edited by hand, another version's
    {"state": "succeeded", "model": "detect/haar/\ud800", "node": "n\udcff", "route": "/\udfff"},
])
def test_a_stored_job_json_cannot_carry_as_such_is_still_shown(extra):
    """NaN, infinities and lone surrogates read from a stored field made every page showing
    the job a 500 (JSON has no NaN; UTF-8 has no lone surrogate)."""
    fields = job(1, **extra)
    single = JSONResponse(public_view(fields)).body  # GET /v1/jobs/{id}
    page = EncodedViews(2**20).page("m", None, [fields], None)
    for data in (single, page):
        text = data.decode("utf-8")
        assert "NaN" not in text and "Infinity" not in text
        json.loads(text)
    view = json.loads(single)
    assert view["state"] == extra["state"] and view["created_at"] in (1.5, None)
