"""A server that leaves the session it was started in, as daemonizing servers do.

    python daemon_server.py PORT PIDFILE [ignore-term] [detach]

It calls setsid() (so a signal to its starter's process group never reaches it), writes
its pid to PIDFILE, and answers every GET with 200 and no identity (a `command` service
that knows nothing of onecard). `ignore-term`: SIGTERM is ignored (only SIGKILL ends it).
`detach`: it forks once more and the parent exits, so the server is re-parented to the
nearest subreaper (the supervisor) and is no longer in its starter's process tree.
`bare-env`: it first execs itself with an empty environment (no onecard marker left).
`note-term`: on SIGTERM it writes PIDFILE.term and exits 0 (a clean stop, told apart from a SIGKILL).
"""

from __future__ import annotations

import http.server
import os
import signal
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status": "ok", "ready": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> None:
    port, pidfile, flags = int(sys.argv[1]), sys.argv[2], set(sys.argv[3:])
    if "bare-env" in flags:
        rest = [f for f in sys.argv[3:] if f != "bare-env"]
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:3], *rest], {})
    os.setsid()
    if "detach" in flags and os.fork():
        os._exit(0)
    if "ignore-term" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "note-term" in flags:
        def note(*_):
            with open(pidfile + ".term", "w") as fh:
                fh.write("SIGTERM")
            os._exit(0)
        signal.signal(signal.SIGTERM, note)
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    with open(pidfile + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    server.serve_forever()


if __name__ == "__main__":
    main()
