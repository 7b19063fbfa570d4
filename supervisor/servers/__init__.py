"""The supervisor's two listening servers: the control socket (one line in, one JSON
document out) and the probe port (HTTP/1.1 GET and HEAD, common/http1.py), with the
connection slots they share, where idle clients make room for newcomers.

They know nothing of the driver: they call the routes and handlers given to them
(driver/endpoints.py). May import: `common`, `supervisor.system`.
"""
