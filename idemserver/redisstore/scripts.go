package redisstore

// A claim is no script: it is SET KEYS[1] value NX GET PX ms, which inserts
// an in-progress record unless one is there, and answers what was there
// (see Store.Claim). The rarer operations are scripts, each one round trip,
// that read the record (one string, laid out as record.go says) with
// string.sub and change it only while it holds the caller's lease token, or
// for a takeover, while the lease it names has ended.
//
// Clocks: the scripts read no instant of Redis's clock. The times in a
// record, and the "now" a takeover compares them with, are the
// middleware's (see the package documentation); the native expiry
// (PEXPIRE, SET PX) is a duration the store computes, which collects
// records no one needs any more: an in-progress record lives its lease
// plus LeaseMargin, so that an ended lease stays visible, to be taken
// over, or extended or completed by its holder if no one took it over; a
// completed one lives its TTL. The takeover script also reads what is left
// of it (PTTL), so that an instance whose clock is ahead of the record's
// writer's replaces nothing that Redis says has long to run.
//
// A Redis at its maxmemory under the noeviction policy refuses a script's
// first write if that write may use more memory (SET, SETRANGE, APPEND),
// and lets every later write of the script through. So each script that
// keeps a claim already granted writes PEXPIRE first, which takes no
// memory: a live handler's extension and completion succeed in a full
// Redis, which grows a little past maxmemory for them. A takeover writes a
// new record with SET first, and a full Redis refuses it, as it refuses
// the SET of a new claim.
//
// Each script answers -1 for a record it cannot read (another layout
// version, or not written by this store), and leaves it alone.
const scriptPrelude = `
local v = redis.call('GET', KEYS[1])
local state, tok, rest
-- readable reports whether v is a record of layout version 1, and sets
-- state, tok (the token) and rest (what follows the token).
local function readable()
  if string.byte(v, 1) ~= 1 or #v < 44 then return false end
  -- the time is below 2^53, as the store writes it and Lua's numbers hold
  if string.byte(v, 35) ~= 0 or string.byte(v, 36) > 31 then return false end
  state = string.sub(v, 2, 2)
  local n = string.byte(v, 43) * 256 + string.byte(v, 44)
  if #v < 44 + n then return false end
  tok = string.sub(v, 45, 44 + n)
  rest = string.sub(v, 45 + n)
  if state == 'p' then return rest == '' end
  return state == 'c' and rest ~= ''
end
-- at returns the record's time, in microseconds.
local function at()
  local t = 0
  for i = 35, 42 do t = t * 256 + string.byte(v, i) end
  return t
end
`

// takeOverScript replaces the record of KEYS[1] with the in-progress record
// ARGV[1], to expire natively in ARGV[2] ms, when the key is absent, or its
// record is completed and has expired at ARGV[3] (µs, the middleware's
// clock), or is in progress under the token ARGV[4] with a lease ended at
// ARGV[3]. ARGV[5] is the new record's token. It serves TakeOver, and a
// Claim that found a completed record expired (ARGV[4] is then empty, and
// no in-progress record is taken).
//
// The record's time was written by the clock of another instance, which
// may be behind the caller's. Its native expiry is a duration that writer
// set, which Redis counts down: an in-progress record's lease ends ARGV[6]
// ms (LeaseMargin) before it, a completed record's expiry at it. When
// that says the record has more than ARGV[7] ms still to run, the clocks
// disagree, and the record stays: taking over a lease whose handler may
// still run, or forgetting a record before its time, runs the handler
// twice.
//
// Reply: 1 when the record is the caller's; otherwise the record that
// stays, -1 for one it cannot read, or {-2, ms} when the clocks disagree,
// with how long Redis says the lease or record still has.
//
// A record in progress under ARGV[5] answers 1: the takeover was sent
// again (go-redis resends a command whose reply was lost) after it had
// won, and tokens are unique to one claim.
const takeOverScript = scriptPrelude + `
if v then
  if not readable() then return -1 end
  local left = redis.call('PTTL', KEYS[1])
  if state == 'p' then
    if tok == ARGV[5] then return 1 end
    if tok ~= ARGV[4] or ARGV[4] == '' or at() > tonumber(ARGV[3]) then return v end
    left = left - tonumber(ARGV[6])
  elseif at() > tonumber(ARGV[3]) then
    return v
  end
  if left > tonumber(ARGV[7]) then return {-2, left} end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
`

// completeScript completes the record of KEYS[1], if it is in progress
// under the token ARGV[1]: its time becomes the expiry ARGV[2] (8 bytes),
// the response ARGV[3] (respcodec's encoding) is appended, and it expires
// natively in ARGV[4] ms; 0 ms deletes it instead. Reply: 1, 0 when the
// token is not there, -1 for a record it cannot read. A record that token
// completed with that very response answers 1 too: the completion was sent
// again after its reply was lost. Any other completion of it answers 0.
const completeScript = scriptPrelude + `
if not v then return 0 end
if not readable() then return -1 end
if tok ~= ARGV[1] then return 0 end
if state == 'c' then
  if rest == ARGV[3] then return 1 end
  return 0
end
if ARGV[4] == '0' then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SETRANGE', KEYS[1], 1, 'c')
redis.call('SETRANGE', KEYS[1], 34, ARGV[2])
redis.call('APPEND', KEYS[1], ARGV[3])
return 1
`

// releaseScript deletes the record of KEYS[1] if it is in progress under
// the token ARGV[1]. Reply: 1, 0 when the token is not there, -1 for a
// record it cannot read.
const releaseScript = scriptPrelude + `
if not v then return 0 end
if not readable() then return -1 end
if state ~= 'p' or tok ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
`

// extendScript moves the lease of KEYS[1] to end at ARGV[2] (8 bytes), if
// the record is in progress under the token ARGV[1], and its native expiry
// to ARGV[3] ms from now. Reply: 1, 0 when the token is not there, -1 for
// a record it cannot read.
const extendScript = scriptPrelude + `
if not v then return 0 end
if not readable() then return -1 end
if state ~= 'p' or tok ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SETRANGE', KEYS[1], 34, ARGV[2])
return 1
`
