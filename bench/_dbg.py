import sys, httpx, time
from bench.common import service
from bench.loadgen import run_load_sync
from tests.images import astronaut, encode
body = encode(astronaut(), "JPEG", quality=90)
clients = [int(x) for x in sys.argv[1].split(",")]
with service('bench.simaccel:create_app', {'profile': sys.argv[2] if len(sys.argv) > 2 else 'sd15-h100', 'max_batch_size': 8, 'max_queue': 64}, threads=2) as svc:
    for c in clients:
        before = httpx.get(svc.url+'/calls').json()['calls']
        res = run_load_sync(svc.url+'/api/v1/sim', body, {"content-type": "image/jpeg"}, c, duration_s=10, warmup=1)
        calls = httpx.get(svc.url+'/calls').json()
        st = httpx.get(svc.url+'/stats').json()['batching']
        ev = [e for e in calls["events"]]
        t0 = ev[0][1]
        for e in ev[-60:]:
            print("   ", e[0], round((e[1]-t0)*1000), round((e[2]-t0)*1000), e[3:] )
        print(c, "rps", round(res.throughput,3), "sizes", calls['recent_sizes'][-(calls['calls']-before):], "waited", st['waited_s'], st['last_decision'])
