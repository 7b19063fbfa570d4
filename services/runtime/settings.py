"""What every onecard service shares in its settings section: the HTTP edge's limits, auth,
the health of its event loop. One class, so that a new connection limit is one line here
and every service (the model services and the jobs service alike) has it.

A model service's settings (services.runtime.pipeline.settings.ModelServiceSettings, public
as ``onecard.Settings``) add the pipeline's keys; the jobs service's add the queue's. Every
limit has a key, a default a production user would expect, and a description the
documentation's limits table is written from.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field


class StartupConfigError(Exception):
    """A setting that cannot work in this environment (a variable it names is missing): the
    service does not start, and services.runtime.serve prints this message alone (no
    traceback) and exits 78 (EX_CONFIG), like any service that cannot start."""


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # ---- connections and protocol (services.runtime.edge) --------------------------------
    max_connections: int = Field(512, ge=1, le=1_000_000,
                                 description="open client connections; a newcomer beyond takes the place of the "
                                 "longest idle one (or the oldest unfinished head), and gets 503 only when every "
                                 "connection has a request in progress")
    connection_queue_timeout_s: float = Field(4.0, ge=0, le=300, allow_inf_nan=False,
                                              description="a newcomer refused for want of a place waits in "
                                              "line this long (from its connect) once its request has begun, "
                                              "oldest first, for one to come free (HAProxy's timeout queue); "
                                              "then 503 too_many_connections")
    max_header_bytes: int = Field(16 * 1024, ge=1024, le=2**20,
                                  description="request line plus headers; beyond: 431 and the connection is closed")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False,
                                    description="time to receive a request's line and headers once it started; "
                                                "then 408")
    body_timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False,
                                  description="time to receive a whole request body; then 408")
    min_body_rate_bytes_s: int = Field(64 * 1024, ge=0, le=2**31,
                                       description="a body arriving slower than this on average (after "
                                       "body_rate_grace_s) gets 408 and the connection is closed (0: no minimum)")
    body_rate_grace_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False,
                                     description="time a body may take before min_body_rate_bytes_s applies")
    min_body_chunk_bytes: int = Field(1024, ge=0, le=2**20,
                                      description="a chunked body whose chunks average fewer bytes than this "
                                      "after its first 1024 chunks gets 413 (0: no minimum)")
    lingering_drain_bytes_s: int = Field(256 * 2**20, ge=2**20, le=2**40,
                                         description="what the connections answered before their body ended "
                                         "may send after the answer, read and dropped, per second in all; "
                                         "beyond, their reads wait")
    keepalive_timeout_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False,
                                       description="an idle kept-alive connection is closed after this")
    send_timeout_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False,
                                  description="a client that takes none of its answer for this long (nginx's "
                                  "send_timeout) is reset and the buffered answer freed")
    send_buffer_bytes: int = Field(256 * 1024, ge=0, le=2**30,
                                   description="the kernel's send queue of each client connection (SO_SNDBUF; "
                                   "Linux doubles it): what a client that reads nothing holds of its answer in "
                                   "the kernel, and what is produced for it before the service waits on it "
                                   "(0: the kernel's autotuning, up to 4 MiB a connection)")
    max_header_count: int = Field(100, ge=8, le=10_000,
                                  description="header fields in one request; beyond: 431 and the connection is closed")
    max_pipelined_requests: int = Field(16, ge=1, le=1024,
                                        description="requests queued behind the one being answered on a connection; "
                                        "beyond: 429 after the earlier answers, and the connection is closed")

    # ---- request bodies ------------------------------------------------------------------
    max_body_bytes: int = Field(20 * 2**20, ge=1024, le=2**31, description="larger bodies get 413")
    max_json_depth: int = Field(32, ge=2, le=1000, description="deeper JSON bodies get 400")
    max_json_items: int = Field(10_000, ge=16, le=100_000_000,
                                description="arrays, objects and elements a JSON body may hold (counted by its "
                                "'[', '{' and ',' bytes before parsing, strings included); beyond: 413")
    retry_after_s: int = Field(1, ge=0, le=3600, description="Retry-After on 503")

    # ---- auth ----------------------------------------------------------------------------
    api_key: str | None = Field(None, description="require this key (Bearer or X-API-Key)", repr=False)
    api_key_env: str | None = Field(None, description="...or read the key from this environment variable")
    basic_auth_env: str | None = Field(None, description="HTTP Basic: an environment variable holding "
                                                         "user:password pairs (comma-separated)")
    basic_auth_file: str | None = Field(None, description="HTTP Basic: a file of user:password pairs (one a line)")
    auth_max_failures: int = Field(10, ge=0, le=1_000_000,
                                   description="failed credential checks per client address within "
                                   "auth_failure_window_s; beyond: 429 with Retry-After (0: no limit)")
    auth_failure_window_s: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False,
                                         description="the window over which auth_max_failures is counted")

    # ---- health --------------------------------------------------------------------------
    loop_stall_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False,
                                description="/healthz fails when the event loop has not run for this long")

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None

    @property
    def auth_required(self) -> bool:
        return bool(self.resolved_api_key() or self.basic_auth_env or self.basic_auth_file)
