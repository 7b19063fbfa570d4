"""The job state transitions on Redis, each one Lua script so that it is atomic.

Keys (prefix P, one model label L, one job id J):
  P:job:J      hash: the job's state and metadata     P:body:J    the JSON body for the service
  P:result:J   the service's answer (bytes)            P:idem:SHA  Idempotency-Key -> J
  P:stream:L   the model's work stream (entries: id=J) P:dead:L    its dead-letter stream
  P:models     hash L -> what units announced          P:stats     hash of counters (dead:L)
  P:cancel     pub/sub channel: J must stop now       P:done      pub/sub channel: J has finished
Stream entries of finished jobs are acknowledged and deleted, so a stream holds only
queued and running work; entries of jobs cancelled while queued stay until a consumer
skips them, which keeps the group's lag exact (deleting undelivered entries makes it
unknown, and KEDA's lagCount scaler reads it).
"""

from __future__ import annotations

# shared Lua helpers, prepended to the scripts that need them
_COMMON = """
local function is_terminal(s) return s == 'succeeded' or s == 'failed' or s == 'cancelled' end
"""

# KEYS: job, body, stream, idem
# ARGV: id, body, has_idem, idem_ttl_ms, group, max_queued, now, field, value, ...
SUBMIT = """
if tonumber(redis.call('XLEN', KEYS[3])) >= tonumber(ARGV[6]) then return {'full'} end
if ARGV[3] == '1' then
  if not redis.call('SET', KEYS[4], ARGV[1], 'NX', 'PX', ARGV[4]) then return {'raced'} end
end
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[3], ARGV[5], '0', 'MKSTREAM')
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('SET', KEYS[2], ARGV[2])
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry, 'queued_at', ARGV[7], 'state', 'queued')
return {'ok', entry}
"""

# KEYS: job, body, stream, dead, stats
# ARGV: group, entry, node, now, max_attempts, ttl_ms, label, dead_maxlen, job_id, consumer, done_channel
START = _COMMON + """
local function drop() redis.call('XACK', KEYS[3], ARGV[1], ARGV[2]); redis.call('XDEL', KEYS[3], ARGV[2]) end
local f = redis.call('HMGET', KEYS[1], 'state', 'entry', 'cancel', 'attempts', 'last_error', 'route', 'queued_at', 'node')
local state = f[1]
if not state then drop(); return {'gone'} end
if f[2] ~= ARGV[2] then drop(); return {'stale'} end
if is_terminal(state) then drop(); return {'done'} end
local function terminal(s, err)
  redis.call('HSET', KEYS[1], 'state', s, 'finished_at', ARGV[4], 'progress', '1', 'error', err)
  redis.call('DEL', KEYS[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  redis.call('PUBLISH', ARGV[11], ARGV[9])
end
local function dead(err)
  terminal('failed', err)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[8], '*', 'id', ARGV[9], 'error', err, 'at', ARGV[4])
  redis.call('HINCRBY', KEYS[5], 'dead:' .. ARGV[7], 1)
  drop()
end
if f[3] == '1' then
  terminal('cancelled', '{"code":"cancelled","message":"cancelled before it ran"}'); drop()
  return {'cancelled'}
end
local last_error = f[5]
if state == 'running' then
  last_error = cjson.encode({code = 'unit_lost', message = 'the unit running it (' .. (f[8] or '?') ..
    ') stopped renewing it'})
  redis.call('HSET', KEYS[1], 'last_error', last_error)
end
local attempts = tonumber(f[4] or '0')
if attempts >= tonumber(ARGV[5]) then
  dead(last_error or '{"code":"attempts_exhausted","message":"no run finished"}')
  return {'dead'}
end
local body = redis.call('GET', KEYS[2])
if not body then dead('{"code":"body_missing","message":"the job has no body"}'); return {'dead'} end
attempts = attempts + 1
redis.call('HSET', KEYS[1], 'state', 'running', 'node', ARGV[3], 'attempts', attempts, 'started_at', ARGV[4],
           'consumer', ARGV[10])
return {'run', attempts, f[6] or '', f[7] or '', body}
"""

# KEYS: stream, job 1..n     ARGV: group, consumer, entry 1..n
# Renews the lease on entries still ours (XCLAIM resets their idle time); answers each
# job's cancel flag, a fallback for a cancel message missed while pub/sub reconnected.
RENEW = """
local out = {}
for i = 2, #KEYS do
  local e = ARGV[i + 1]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], e, e, 1, ARGV[2])
  if #p > 0 then redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, e, 'JUSTID') end
  out[#out + 1] = redis.call('HGET', KEYS[i], 'cancel') or '0'
end
return out
"""

# KEYS: job, body, result, stream, dead, stats
# ARGV: group, entry, state, now, ttl_ms, has_result, result, content_type, status, headers, error,
#       dead_letter, label, dead_maxlen, job_id, attempt, cancel_channel, done_channel
FINISH = _COMMON + """
redis.call('XACK', KEYS[4], ARGV[1], ARGV[2]); redis.call('XDEL', KEYS[4], ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'state', 'attempts')
if not f[1] then return 'gone' end
if is_terminal(f[1]) then return 'duplicate' end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finished_at', ARGV[4], 'progress', '1', 'result_type', ARGV[8],
           'result_status', ARGV[9], 'result_headers', ARGV[10], 'error', ARGV[11])
if ARGV[6] == '1' then redis.call('SET', KEYS[3], ARGV[7], 'PX', ARGV[5]) end
redis.call('DEL', KEYS[2])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[12] == '1' then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[14], '*', 'id', ARGV[15], 'error', ARGV[11], 'at', ARGV[4])
  redis.call('HINCRBY', KEYS[6], 'dead:' .. ARGV[13], 1)
end
-- another unit runs it too (it was reclaimed from us, or we from it): tell it to stop
if f[2] ~= ARGV[16] then redis.call('PUBLISH', ARGV[17], ARGV[15]) end
redis.call('PUBLISH', ARGV[18], ARGV[15])
return 'ok'
"""

# KEYS: job, body, stream, dead, stats
# ARGV: group, entry, now, error, counted, max_attempts, ttl_ms, label, dead_maxlen, job_id, done_channel
REQUEUE = _COMMON + """
local function drop() redis.call('XACK', KEYS[3], ARGV[1], ARGV[2]); redis.call('XDEL', KEYS[3], ARGV[2]) end
local f = redis.call('HMGET', KEYS[1], 'state', 'entry', 'cancel', 'attempts', 'last_error')
drop()
if not f[1] then return 'gone' end
if is_terminal(f[1]) or f[2] ~= ARGV[2] then return 'done' end
local err = f[5]
if ARGV[4] ~= '' then err = ARGV[4]; redis.call('HSET', KEYS[1], 'last_error', err) end
local function terminal(s, e)
  redis.call('HSET', KEYS[1], 'state', s, 'finished_at', ARGV[3], 'progress', '1', 'error', e)
  redis.call('DEL', KEYS[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
  redis.call('PUBLISH', ARGV[11], ARGV[10])
end
if f[3] == '1' then
  terminal('cancelled', '{"code":"cancelled","message":"cancelled while it ran"}')
  return 'cancelled'
end
local attempts = tonumber(f[4] or '0')
if ARGV[5] ~= '1' then attempts = math.max(0, attempts - 1); redis.call('HSET', KEYS[1], 'attempts', attempts) end
if attempts >= tonumber(ARGV[6]) then
  err = err or '{"code":"attempts_exhausted","message":"no run finished"}'
  terminal('failed', err)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', 'id', ARGV[10], 'error', err, 'at', ARGV[3])
  redis.call('HINCRBY', KEYS[5], 'dead:' .. ARGV[8], 1)
  return 'dead'
end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[10])
redis.call('HSET', KEYS[1], 'state', 'queued', 'entry', entry, 'node', '', 'queued_at', ARGV[3], 'consumer', '')
return 'requeued'
"""

# KEYS: job, body     ARGV: now, ttl_ms, cancel_channel, job_id, done_channel
CANCEL = _COMMON + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if is_terminal(state) then return state end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'queued' then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[1], 'progress', '1',
             'error', '{"code":"cancelled","message":"cancelled before it ran"}')
  redis.call('DEL', KEYS[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PUBLISH', ARGV[5], ARGV[4])
  return 'cancelled'
end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 'cancelling'
"""

# KEYS: stream, dead, stats   ARGV: group, entry, reason, now, dead_maxlen, label
# An entry that is not a job of ours (no id, a malformed id): set aside, never run.
DISCARD = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]); redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'entry', ARGV[2], 'error', ARGV[3], 'at', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'dead:' .. ARGV[6], 1)
return 'ok'
"""
