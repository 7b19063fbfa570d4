"""The job state transitions on Redis, each one Lua script so that it is atomic. The
decisions (retry or dead-letter, after how long) come from services/jobs/policy.py; a
script only checks what it must check atomically (the lease, a cancel) and carries them out.

Keys (prefix P, model label L, job id J; priority level streams: high, normal, low):
  P:job:J            hash: the job's state and metadata   P:body:J   the JSON body for the service
  P:result:J         the service's answer (bytes)          P:idem:SHA Idempotency-Key -> {id, sha, model}
  P:stream:L[:high|:low]  the model's work streams (entries: id=J), normal without a suffix
  P:delayed:L        sorted set: retries waiting for their backoff ("level:J" by due time, ms)
  P:dead:L           its dead-letter stream (a log)        P:idx:STATE:L  sorted set of the jobs in a
  P:models           hash L -> what units announced        state (and "dead"), by when they entered it (µs)
  P:stats            hash of counters (dead:L)             P:reserved bytes reserved for the results of
  P:epoch            a marker: missing = Redis lost its data   accepted jobs not finished yet
  P:cancel, P:done   pub/sub: J must stop now; J has finished
A job's ``lease`` is a token written when a unit starts it; every write of that run (renew,
finish, retry) must show it, so a unit whose job was taken over can no longer write.
Stream entries of finished jobs are acknowledged and deleted, so a stream holds only queued
and running work; entries of jobs cancelled while queued stay until a consumer skips them,
which keeps the group's lag exact (KEDA's lagCount scaler reads it).
"""

from __future__ import annotations

from services.jobs.lua import DENY_OOM, READ_ONLY, Script

# the keys and arguments every script that ends a job needs (its bookkeeping helpers use them)
JOB_KEYS = ("job", "body", "reserved", "dead", "stats", "idx_queued", "idx_running", "idx_succeeded", "idx_failed",
            "idx_cancelled", "idx_dead")
JOB_ARGS = ("job_id", "now", "now_ms", "ttl_ms", "label", "dead_maxlen", "done_channel")

_HELPERS = """
local function is_terminal(s) return s == 'succeeded' or s == 'failed' or s == 'cancelled' end
local function now_us()  -- Redis's own clock, in microseconds: one order for every unit's writes
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function index_as(state)
  redis.call('ZREM', K.idx_queued, A.job_id); redis.call('ZREM', K.idx_running, A.job_id)
  redis.call('ZREM', K.idx_failed, A.job_id); redis.call('ZREM', K.idx_dead, A.job_id)
  local score = now_us()
  redis.call('ZADD', K['idx_' .. state], score, A.job_id)
  if is_terminal(state) then  -- their records expire: so do their index entries
    redis.call('ZREMRANGEBYSCORE', K['idx_' .. state], '-inf', '(' .. (score - tonumber(A.ttl_ms) * 1000))
  end
end
local function release()
  local r = tonumber(redis.call('HGET', K.job, 'reserve') or '0') or 0
  if r > 0 then
    if redis.call('DECRBY', K.reserved, r) < 0 then redis.call('SET', K.reserved, 0) end
    redis.call('HSET', K.job, 'reserve', 0)
  end
end
local function terminal(state, err, keep_body)
  redis.call('HSET', K.job, 'state', state, 'finished_at', A.now, 'progress', '1', 'error', err, 'lease', '')
  if keep_body then redis.call('PEXPIRE', K.body, A.ttl_ms) else redis.call('DEL', K.body) end
  redis.call('PEXPIRE', K.job, A.ttl_ms)
  release()
  index_as(state)
  redis.call('PUBLISH', A.done_channel, A.job_id)
end
local function bury(err)  -- failed and dead-lettered; the body stays as long as the record, for a redrive
  terminal('failed', err, true)
  redis.call('HSET', K.job, 'dead', '1')
  local score = now_us()
  redis.call('ZADD', K.idx_dead, score, A.job_id)
  redis.call('ZREMRANGEBYSCORE', K.idx_dead, '-inf', '(' .. (score - tonumber(A.ttl_ms) * 1000))
  redis.call('XADD', K.dead, 'MAXLEN', '~', A.dead_maxlen, '*', 'id', A.job_id, 'error', err, 'at', A.now)
  redis.call('HINCRBY', K.stats, 'dead:' .. A.label, 1)
end
local function budget_left(extra)
  -- bytes the queue may still fill: the budget minus what Redis holds and what accepted jobs reserved
  local info = redis.call('INFO', 'memory')
  local used = tonumber(string.match(info, 'used_memory:(%d+)')) or 0
  local maxmem = tonumber(string.match(info, 'maxmemory:(%d+)')) or 0
  local budget = tonumber(A.budget)
  if maxmem > 0 then
    local b = math.floor(maxmem * (1 - tonumber(A.headroom)))
    if budget == 0 or b < budget then budget = b end
  end
  if budget == 0 then return nil, used, budget end
  local reserved = tonumber(redis.call('GET', K.reserved) or '0') or 0
  return budget - used - reserved + extra, used, budget
end
"""
CANCELLED_BEFORE = '{"code":"cancelled","message":"cancelled before it ran"}'
CANCELLED_WHILE = '{"code":"cancelled","message":"cancelled while it ran"}'

# A submit adds work: refused by a Redis at its maxmemory (no allow-oom), and by the queue's
# own budget when the body plus the room reserved for its result would not fit.
SUBMIT = Script("SUBMIT", ("stream", "idem", *JOB_KEYS),
                ("body", "idem_value", "idem_ttl_ms", "group", "max_queued", "fields", "reserve", "budget", "headroom",
                 *JOB_ARGS), flags=DENY_OOM, helpers=_HELPERS, body="""
if redis.call('ZCARD', K.idx_queued) >= tonumber(A.max_queued) then return {'full'} end
local left, used, budget = budget_left(0)
if left and left < string.len(A.body) + tonumber(A.reserve) + 2048 then
  return {'nomem', tostring(used), redis.call('GET', K.reserved) or '0', tostring(budget)}
end
if A.idem_value ~= '' then
  if not redis.call('SET', K.idem, A.idem_value, 'NX', 'PX', A.idem_ttl_ms) then return {'raced'} end
end
pcall(redis.call, 'XGROUP', 'CREATE', K.stream, A.group, '0', 'MKSTREAM')
for k, v in pairs(cjson.decode(A.fields)) do redis.call('HSET', K.job, k, v) end
redis.call('SET', K.body, A.body)
redis.call('INCRBY', K.reserved, A.reserve)
local entry = redis.call('XADD', K.stream, '*', 'id', A.job_id)
redis.call('HSET', K.job, 'entry', entry, 'queued_at', A.now, 'state', 'queued', 'reserve', A.reserve,
           'result_reserve', A.reserve)
index_as('queued')
return {'ok', entry}
""")

# A delivered entry becomes a run, with a new lease. A job found 'running' was lost with its
# unit: charged an attempt only if that run was alone (solo), else marked to run alone.
START = Script("START", ("stream", *JOB_KEYS),
               ("group", "entry", "node", "consumer", "lease", *JOB_ARGS), helpers=_HELPERS, body="""
local function drop() redis.call('XACK', K.stream, A.group, A.entry); redis.call('XDEL', K.stream, A.entry) end
local f = redis.call('HMGET', K.job, 'state', 'entry', 'cancel', 'attempts', 'route', 'queued_at', 'node', 'solo',
                     'isolate', 'runs', 'priority', 'traceparent', 'tracestate')
local state = f[1]
if not state then drop(); return {'gone'} end
if f[2] ~= A.entry then drop(); return {'stale'} end
if is_terminal(state) then drop(); return {'done'} end
if f[3] == '1' then terminal('cancelled', cjson.encode({code = 'cancelled', message = 'cancelled before it ran'}),
                              false); drop(); return {'cancelled'} end
local attempts, isolate = tonumber(f[4] or '0'), f[9] or '0'
if state == 'running' then
  redis.call('HSET', K.job, 'last_error', cjson.encode({code = 'unit_lost', message = 'the unit running it (' ..
             (f[7] or '?') .. ') stopped renewing it'}))
  if f[8] == '1' then attempts = attempts + 1 else isolate = '1' end
end
local body = redis.call('GET', K.body)
if not body then bury('{"code":"body_missing","message":"the job has no body"}'); drop(); return {'dead'} end
local runs = tonumber(f[10] or '0') + 1
redis.call('HSET', K.job, 'state', 'running', 'node', A.node, 'consumer', A.consumer, 'lease', A.lease,
           'attempts', attempts, 'runs', runs, 'started_at', A.now, 'isolate', isolate, 'solo', '0')
index_as('running')
return {'run', tostring(attempts), f[5] or '', f[6] or '', body, isolate, tostring(runs), f[11] or 'normal',
        f[12] or '', f[13] or ''}
""")

# KEYS: (job, stream) per run   ARGV: group, consumer, then (entry, lease) per run
# A run whose lease is still ours: its entry's idle time is reset (XCLAIM) and its cancel flag
# answered (a fallback for a cancel message missed while pub/sub reconnected); else 'lost'.
RENEW = Script("RENEW", (), ("group", "consumer"), variadic=True, body="""
local out = {}
for i = 1, #KEYS / 2 do
  local job, stream, entry, lease = KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i + 1], ARGV[2 * i + 2]
  local f = redis.call('HMGET', job, 'lease', 'cancel')
  if f[1] ~= lease then
    out[i] = 'lost'
  else
    redis.call('XCLAIM', stream, A.group, A.consumer, 0, entry, 'JUSTID')
    out[i] = f[2] or '0'
  end
end
return out
""")

# An isolated run (after a crash) is marked, so that losing its unit is charged to it alone.
SOLO = Script("SOLO", ("job",), ("lease",), body="""
if redis.call('HGET', K.job, 'lease') ~= A.lease then return 0 end
redis.call('HSET', K.job, 'solo', '1')
return 1
""")

# The run's outcome, written once and only by the lease holder. A result larger than the room
# reserved for it is stored only if the queue's budget still has the difference.
FINISH = Script("FINISH", ("stream", "result", *JOB_KEYS),
                ("group", "entry", "lease", "state", "has_result", "result", "result_json", "content_type", "status",
                 "headers", "error", "dead_letter", "attempts", "node", "consumer", "cancel_channel", "budget",
                 "headroom", *JOB_ARGS), helpers=_HELPERS, body="""
local function drop() redis.call('XACK', K.stream, A.group, A.entry); redis.call('XDEL', K.stream, A.entry) end
local f = redis.call('HMGET', K.job, 'state', 'lease', 'reserve')
if not f[1] then drop(); return 'gone' end
if is_terminal(f[1]) then drop(); return 'duplicate' end
if f[2] ~= A.lease then return 'lost' end
drop()
local state, err, has_result, verdict = A.state, A.error, A.has_result == '1', 'ok'
if has_result then
  local size, reserve = string.len(A.result), tonumber(f[3] or '0') or 0
  if size > reserve then
    local left = budget_left(reserve)
    if left and left < size then
      state, has_result, verdict = 'failed', false, 'no_room'
      err = cjson.encode({code = 'result_too_large', message = 'the result (' .. size .. ' bytes) is over the ' ..
                          reserve .. ' bytes reserved for it at submit and the queue has no room for it'})
    end
  end
end
redis.call('HSET', K.job, 'result_type', has_result and A.content_type or '', 'result_status', A.status,
           'result_headers', A.headers, 'result_json', has_result and A.result_json or '0', 'attempts', A.attempts,
           'node', A.node, 'consumer', A.consumer)
if has_result then redis.call('SET', K.result, A.result, 'PX', A.ttl_ms) end
if A.dead_letter == '1' and state == 'failed' then bury(err) else terminal(state, err, false) end
return verdict
""")

# A run that did not finish its job: back on the queue (at once, or after its backoff through
# the delayed set), dead-lettered, or cancelled (a cancel came meanwhile), as the policy decided.
REQUEUE = Script("REQUEUE", ("stream", "to_stream", "delayed", *JOB_KEYS),
                 ("group", "entry", "lease", "error", "action", "attempts", "delay_ms", "isolate", "level", *JOB_ARGS),
                 helpers=_HELPERS, body="""
local f = redis.call('HMGET', K.job, 'state', 'lease', 'cancel', 'last_error')
if not f[1] then return 'gone' end
if is_terminal(f[1]) then return 'done' end
if f[2] ~= A.lease then return 'lost' end
redis.call('XACK', K.stream, A.group, A.entry); redis.call('XDEL', K.stream, A.entry)
local err = f[4]
if A.error ~= '' then err = A.error; redis.call('HSET', K.job, 'last_error', err) end
redis.call('HSET', K.job, 'attempts', A.attempts)
if A.isolate == '1' then redis.call('HSET', K.job, 'isolate', '1') end
if f[3] == '1' then terminal('cancelled', cjson.encode({code = 'cancelled', message = 'cancelled while it ran'}),
                              false); return 'cancelled' end
if A.action == 'dead' then bury(err or '{"code":"attempts_exhausted","message":"no run finished"}'); return 'dead' end
redis.call('HSET', K.job, 'state', 'queued', 'node', '', 'consumer', '', 'lease', '', 'queued_at', A.now)
index_as('queued')
if tonumber(A.delay_ms) > 0 then
  local due = tonumber(A.now_ms) + tonumber(A.delay_ms)
  redis.call('ZADD', K.delayed, due, A.level .. ':' .. A.job_id)
  redis.call('HSET', K.job, 'entry', '', 'retry_at', tostring(due / 1000))
else
  local entry = redis.call('XADD', K.to_stream, '*', 'id', A.job_id)
  redis.call('HSET', K.job, 'entry', entry, 'retry_at', '')
end
return 'requeued'
""")

# A retry whose backoff is over goes to the end of its priority level's stream.
PROMOTE = Script("PROMOTE", ("job", "delayed", "stream"), ("member", "job_id", "now"), body="""
if redis.call('ZREM', K.delayed, A.member) == 0 then return 'gone' end
if redis.call('HGET', K.job, 'state') ~= 'queued' then return 'skip' end
local entry = redis.call('XADD', K.stream, '*', 'id', A.job_id)
redis.call('HSET', K.job, 'entry', entry, 'retry_at', '', 'queued_at', A.now)
return 'ok'
""")

# A delivered run dead-lettered without running (its attempts were spent when its unit was lost).
BURY = Script("BURY", ("stream", *JOB_KEYS), ("group", "entry", "lease", "error", *JOB_ARGS), helpers=_HELPERS,
              body="""
if redis.call('HGET', K.job, 'lease') ~= A.lease then return 'lost' end
redis.call('XACK', K.stream, A.group, A.entry); redis.call('XDEL', K.stream, A.entry)
local err = redis.call('HGET', K.job, 'last_error')
bury(err or A.error)
return 'dead'
""")

CANCEL = Script("CANCEL", JOB_KEYS, ("cancel_channel", *JOB_ARGS), helpers=_HELPERS, body="""
local state = redis.call('HGET', K.job, 'state')
if not state then return 'missing' end
if is_terminal(state) then return state end
redis.call('HSET', K.job, 'cancel', '1')
if state == 'queued' then
  terminal('cancelled', cjson.encode({code = 'cancelled', message = 'cancelled before it ran'}), false)
  return 'cancelled'
end
redis.call('PUBLISH', A.cancel_channel, A.job_id)
return 'cancelling'
""")

# A dead-lettered job back on its queue, attempts reset, with its result's room reserved again.
REDRIVE = Script("REDRIVE", ("stream", *JOB_KEYS), ("group", "budget", "headroom", *JOB_ARGS), flags=DENY_OOM,
                 helpers=_HELPERS, body="""
local f = redis.call('HMGET', K.job, 'state', 'dead', 'result_reserve')
if not f[1] then return 'missing' end
if f[1] ~= 'failed' or f[2] ~= '1' then return 'not_dead' end
local size = redis.call('STRLEN', K.body)
if size == 0 then return 'no_body' end
local reserve = tonumber(f[3] or '0') or 0
local left = budget_left(0)
if left and left < size + reserve + 2048 then return 'nomem' end
redis.call('PERSIST', K.job); redis.call('PERSIST', K.body)
pcall(redis.call, 'XGROUP', 'CREATE', K.stream, A.group, '0', 'MKSTREAM')
local entry = redis.call('XADD', K.stream, '*', 'id', A.job_id)
redis.call('HSET', K.job, 'state', 'queued', 'dead', '', 'attempts', 0, 'error', '', 'finished_at', '', 'progress', 0,
           'lease', '', 'node', '', 'consumer', '', 'cancel', '', 'reserve', reserve, 'entry', entry, 'queued_at',
           A.now, 'retry_at', '', 'redriven_at', A.now)
redis.call('INCRBY', K.reserved, reserve)
index_as('queued')
return 'ok'
""")

# KEYS: stream, dead, stats   An entry that is not a job of ours (no id, a malformed id): set aside, never run.
DISCARD = Script("DISCARD", ("stream", "dead", "stats"), ("group", "entry", "reason", "now", "dead_maxlen", "label"),
                 body="""
redis.call('XACK', K.stream, A.group, A.entry); redis.call('XDEL', K.stream, A.entry)
redis.call('XADD', K.dead, 'MAXLEN', '~', A.dead_maxlen, '*', 'entry', A.entry, 'error', A.reason, 'at', A.now)
redis.call('HINCRBY', K.stats, 'dead:' .. A.label, 1)
return 'ok'
""")

# What a unit announces of its model, put back whenever it is missing (a Redis that lost its
# data, a flush) or differs (the last unit to announce wins), with the model's consumer groups.
# The epoch marker is created once;
# a unit that sees another epoch than the one it knew has seen Redis lose its data.
ANNOUNCE = Script("ANNOUNCE", ("models", "epoch"), ("label", "info", "group", "epoch"), variadic=True, body="""
local changed = 0  -- 1: the entry was missing; 2: another unit announced it otherwise (a mixed pool)
if A.label ~= '' then
  local known = redis.call('HGET', K.models, A.label)
  if known ~= A.info then
    redis.call('HSET', K.models, A.label, A.info)
    changed = known and 2 or 1
  end
end
for i = 3, #KEYS do pcall(redis.call, 'XGROUP', 'CREATE', KEYS[i], A.group, '0', 'MKSTREAM') end
local epoch = redis.call('GET', K.epoch)
if not epoch then redis.call('SET', K.epoch, A.epoch); epoch = A.epoch end
return {changed, epoch}
""")

SCRIPTS = {s.name: s for s in (SUBMIT, START, RENEW, SOLO, FINISH, REQUEUE, PROMOTE, BURY, CANCEL, REDRIVE, DISCARD,
                               ANNOUNCE)}
__all__ = ["SCRIPTS", "READ_ONLY"]
