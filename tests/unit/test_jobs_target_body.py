"""A job's body reaches its service whole, with its length declared, and a big one is handed
to the HTTP client a view at a time (services.jobs.targets): handed over whole, the event
loop's transport copied what the socket did not take at once, with the GIL held."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.jobs import targets
from services.jobs.settings import TargetSettings
from services.jobs.targets import Target


async def _serve_once(got: dict):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        got["head"] = head.decode("latin-1").lower()
        length = int(next(line.split(":", 1)[1] for line in got["head"].split("\r\n")
                          if line.startswith("content-length:")))
        got["body"] = await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("size", [100, targets.STREAMED_BODY_BYTES - 1, targets.STREAMED_BODY_BYTES * 5 + 17])
def test_a_job_body_arrives_whole_with_its_length_and_big_ones_go_as_views(monkeypatch, size):
    body = os.urandom(size)
    handed = []
    real = targets.aiohttp.ClientSession.request

    def spy(self, method, url, **kw):  # what the HTTP client is given (the real call still runs)
        handed.append(kw.get("data"))
        return real(self, method, url, **kw)

    monkeypatch.setattr(targets.aiohttp.ClientSession, "request", spy)

    async def main():
        got: dict = {}
        server = await _serve_once(got)
        port = server.sockets[0].getsockname()[1]
        target = Target("svc", f"http://127.0.0.1:{port}", TargetSettings(), run_timeout_s=10, dry_run_timeout_s=5)
        try:
            answer = await target.call("/api/v1/x", body, "0" * 32)
        finally:
            await target.close()
            server.close()
        return answer, got

    answer, got = asyncio.run(main())
    assert answer.status == 200 and got["body"] == body
    assert f"content-length: {size}" in got["head"] and "transfer-encoding" not in got["head"]
    assert "content-type: application/json" in got["head"] and "x-onecard-job: " + "0" * 32 in got["head"]
    streamed = not isinstance(handed[0], bytes)
    assert streamed == (size >= targets.STREAMED_BODY_BYTES)


@pytest.mark.parametrize("answer", [b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\n{}",
                                    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}"])
def test_a_broken_answer_is_told_without_the_services_api_key_or_address(monkeypatch, answer):
    """The error a failed call raises becomes the job's public error: aiohttp's own text of a
    bad answer carried the request's headers (the service's API key) and its address."""
    monkeypatch.setenv("ONECARD_TEST_TARGET_KEY", "s3cr3t-target-key-123")

    async def main():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = Target("svc", f"http://127.0.0.1:{port}", TargetSettings(api_key_env="ONECARD_TEST_TARGET_KEY"),
                        run_timeout_s=10, dry_run_timeout_s=5)
        try:
            with pytest.raises(targets.TargetUnreachable) as caught:
                await target.call("/api/v1/x", b"{}", "0" * 32)
        finally:
            await target.close()
            server.close()
        return caught.value, port

    exc, port = asyncio.run(main())
    text = str(exc)
    assert text.startswith("svc: ") and len(text) < 300, text
    assert "s3cr3t" not in text and str(port) not in text and "x-api-key" not in text.lower(), text
