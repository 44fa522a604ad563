"""The Lua scripts of the Redis lease table (broker/fleet/leases.py): each lease transition is one of
them, run atomically by the store.

A lease is a hash under `<prefix>l:<id>`; the live leases sit in the sorted set `<prefix>exp` by
deadline and in a set per holder (`h:`) and per reader (`r:`); ended ones in `ended` (history).
Every key shares one hash tag, so on a Cluster each script runs on one slot. A script answers a
lease's fields in a fixed order (`fields`, matched by position by the table: no names to parse).
"""

# Shared by the scripts: end a live lease (drop it from the live sets, keep it as history).
END = """
local function finish(p, id, f, history, keep_ms)
  redis.call('ZREM', p .. 'exp', id)
  redis.call('SREM', p .. 'h:' .. f.h, id)
  if f.r ~= '' then redis.call('SREM', p .. 'r:' .. f.r, id) end
  redis.call('PEXPIRE', p .. 'l:' .. id, keep_ms)
  redis.call('ZADD', p .. 'ended', redis.call('INCR', p .. 'endseq'), id)
  local over = redis.call('ZCARD', p .. 'ended') - history
  if over > 0 then
    local popped = redis.call('ZPOPMIN', p .. 'ended', over)
    for i = 1, #popped, 2 do redis.call('DEL', p .. 'l:' .. popped[i]) end
  end
end
-- A lease's fields in the order RedisLeaseTable._lease reads them (no names to match there).
local function fields(key)
  return redis.call('HMGET', key, 'id', 'h', 'r', 'lay', 'ten', 'tier', 'bh', 'bi', 'st', 'ttl', 'dl',
    'ep', 'c', 'd', 'q')
end
local function load(p, id)
  local raw = redis.call('HGETALL', p .. 'l:' .. id)
  if #raw == 0 then return nil end
  local f = {}
  for i = 1, #raw, 2 do f[raw[i]] = raw[i + 1] end
  f.st = tonumber(f.st); f.ep = tonumber(f.ep); f.dl = tonumber(f.dl); f.ttl = tonumber(f.ttl)
  return f
end
local function revoke(p, id, f, cause, detail, history, keep_ms)
  local key = p .. 'l:' .. id
  redis.call('HSET', key, 'st', 5, 'c', cause, 'd', detail, 'ep', f.ep + 1)
  finish(p, id, f, history, keep_ms)
end
local function expire(p, id, f, history, keep_ms)
  if f.st == 1 then
    revoke(p, id, f, 5, 'holder did not answer the pin in time', history, keep_ms)
  else
    revoke(p, id, f, 1, 'not renewed within ' .. f.ttlshown .. ' s', history, keep_ms)
  end
end
"""

# KEYS: the expiry set (it routes the call: every key shares its hash tag).  ARGV: prefix, op, id, history, keep_ms, args...
# Answers {'ok', fields...}, {'E', code, fields...}, or {} (nothing to do).
TRANSITION = (
    END
    + """
local p, op, id, history, keep_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local key = p .. 'l:' .. id
local f = load(p, id)
if op == 'revoke' or op == 'expire_if_due' then
  if f == nil or f.st > 3 then return {} end
  if op == 'revoke' then
    revoke(p, id, f, tonumber(ARGV[6]), ARGV[7], history, keep_ms)
  else
    if f.dl > tonumber(ARGV[6]) then return {} end
    expire(p, id, f, history, keep_ms)
  end
  return {'ok', unpack(fields(key))}
end
if f == nil then return {'E', 'unknown'} end
if op == 'claim' and f.r ~= ARGV[6] then
  -- a reader the hold did not name: the caller vets the pair first (ARGV[11] = '1'), then counts
  if ARGV[11] == '1' then return {'V', unpack(fields(key))} end
  local most = tonumber(ARGV[10])
  if most > 0 then
    local n = redis.call('SCARD', p .. 'r:' .. ARGV[6])
    if n >= most then return {'L', n} end
  end
end
if f.st > 3 then return {'E', 'ended', unpack(fields(key))} end
local who, now = ARGV[6], tonumber(ARGV[7])
if op ~= 'activate' and f.dl <= now then
  expire(p, id, f, history, keep_ms)
  return {'X', unpack(fields(key))}
end
if op == 'claim' then
  if f.st ~= 2 then return {'E', 'state', unpack(fields(key))} end
  if f.r ~= '' and f.r ~= who then return {'E', 'reader', unpack(fields(key))} end
  if f.r == '' then redis.call('SADD', p .. 'r:' .. who, id) end
  local ttl = tonumber(ARGV[8])
  redis.call('HSET', key, 'r', who, 'st', 3, 'ep', f.ep + 1, 'ttl', ARGV[8], 'ttlshown', ARGV[9],
    'dl', now + ttl)
  redis.call('ZADD', p .. 'exp', now + ttl, id)
elseif op == 'activate' then
  if f.h ~= who then return {'E', 'holder', unpack(fields(key))} end
  if f.st ~= 1 then return {'E', 'state', unpack(fields(key))} end
  redis.call('HSET', key, 'bi', ARGV[8], 'st', 3, 'ep', f.ep + 1, 'dl', now + f.ttl)
  redis.call('ZADD', p .. 'exp', now + f.ttl, id)
elseif op == 'renew' then
  if who ~= f.h and who ~= f.r then return {'E', 'party', unpack(fields(key))} end
  if f.st == 1 then return {'E', 'pending', unpack(fields(key))} end
  local dl = now + tonumber(ARGV[8])
  if dl > f.dl then
    redis.call('HSET', key, 'dl', dl)
    redis.call('ZADD', p .. 'exp', dl, id)
  end
  redis.call('HSET', key, 'ep', f.ep + 1)
elseif op == 'release' then
  if f.st ~= 3 then return {'E', 'state', unpack(fields(key))} end
  if who ~= f.r then return {'E', 'reader', unpack(fields(key))} end
  local epoch = tonumber(ARGV[8])
  if epoch ~= 0 and epoch ~= f.ep then return {'E', 'epoch', unpack(fields(key))} end
  redis.call('HSET', key, 'st', 4, 'ep', f.ep + 1)
  finish(p, id, f, history, keep_ms)
end
return {'ok', unpack(fields(key))}
"""
)

# A holder's inbox of lease-end notices from other replicas (see broker/fleet/notify.py), emptied:
# {tag, notice...}, or {} when it holds none.
TAKE = """
local function take(inbox, tag)
  local ends = redis.call('LRANGE', inbox, 0, -1)
  if #ends == 0 then return {} end
  redis.call('DEL', inbox)
  table.insert(ends, 1, tag)
  return ends
end
"""

# KEYS: the expiry set, and (optional) the holder's inbox of lease-end notices, taken in the same
# call. ARGV: prefix, id, holder, reader, most (live leases per engine; 0: no limit), deadline,
# then the lease's fields and values.  -> {} once created, {'ends', notice...} once created with
# the holder's waiting notices, or {'held'|'read', count} when a limit refuses it.
CREATE = (
    TAKE
    + """
local p, id, h, r, most = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
if most > 0 then
  local n = redis.call('SCARD', p .. 'h:' .. h)
  if n >= most then return {'held', n} end
  if r ~= '' then
    n = redis.call('SCARD', p .. 'r:' .. r)
    if n >= most then return {'read', n} end
  end
end
redis.call('HSET', p .. 'l:' .. id, unpack(ARGV, 7))
redis.call('ZADD', p .. 'exp', ARGV[6], id)
redis.call('SADD', p .. 'h:' .. h, id)
if r ~= '' then redis.call('SADD', p .. 'r:' .. r, id) end
if #KEYS > 1 then return take(KEYS[2], 'ends') end
return {}
"""
)

# The notices of ended leases that wait in a holder's inbox (KEYS[1]), taken: {} when none.
DRAIN = TAKE + "return take(KEYS[1], 'ends')"

# KEYS: holders' inboxes; ARGV: a channel and a message for each. Publishes each message whose
# inbox still holds notices (its holder's replica did not take them with a hold meanwhile).
NUDGE = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PUBLISH', ARGV[2 * i - 1], ARGV[2 * i]) end
end
return 0
"""

# ARGV: prefix, now, limit, history, keep_ms. Each due lease is expired by exactly one caller.
# Answers the earliest deadline still in the expiry set, then the fields of each lease it expired.
EXPIRE_DUE = (
    END
    + """
local p, now, limit, history, keep_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'exp', '-inf', now, 'LIMIT', 0, limit)) do
  local f = load(p, id)
  if f == nil or f.st > 3 then
    redis.call('ZREM', p .. 'exp', id)
  elseif f.dl > now then
    redis.call('ZADD', p .. 'exp', f.dl, id)
  else
    expire(p, id, f, history, keep_ms)
    table.insert(out, fields(p .. 'l:' .. id))
  end
end
-- First, the earliest deadline left ('' when none): the caller skips passes until then.
local first = redis.call('ZRANGE', p .. 'exp', 0, 0, 'WITHSCORES')
table.insert(out, 1, first[2] or '')
return out
"""
)
