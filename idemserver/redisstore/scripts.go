package redisstore

// The scripts keep a record in one hash under KEYS[1], with the fields
//
//	f  fingerprint, 32 bytes
//	t  lease token; only while in progress
//	l  end of the lease, in microseconds of the Redis server's clock;
//	   only while in progress
//	r  the response, in respcodec's encoding; only once completed
//	e  expiry of the completed record, in microseconds of the server's clock
//	c  the lease token that completed the record, so that the completion,
//	   sent again when its reply was lost, is told it succeeded
//
// Every instant is read from TIME inside the script, so the server's clock
// is the only one that judges leases and expiry; the client sends durations
// and gets durations back. The hash expires natively: an in-progress record
// at the end of its lease plus a margin (ARGV, in microseconds), so that an
// expired lease stays visible to be taken over or extended, and a completed
// one at its own expiry.
//
// A Redis at its maxmemory under the noeviction policy refuses a script's
// first write if that write may use more memory (HSET, not DEL, HDEL or
// PEXPIRE), and lets every later write of the script through. So the order
// of the writes decides what a full Redis refuses: a new claim writes HSET
// first, and fails, so that Redis does not grow past its bound; an
// extension, a completion and a claim sent again, which keep a claim that
// was already granted, write PEXPIRE or HDEL first, and succeed, so that a
// live handler does not lose its key because Redis is full.
//
// Numbers are passed to redis.call through string.format('%.0f'), since
// Lua's own conversion of a double loses digits of a 16-digit timestamp.
const scriptPrelude = `
local function int(x) return string.format('%.0f', x) end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- pexpire lets the record at KEYS[1] live us microseconds more, at least 1 ms.
local function pexpire(us)
  local ms = math.ceil(us / 1000)
  if ms < 1 then ms = 1 end
  redis.call('PEXPIRE', KEYS[1], int(ms))
end
`

// claimScript claims KEYS[1] or reports the record there.
//
// ARGV: fingerprint, token, lease duration (µs), margin (µs), and for a
// takeover the expired token (absent for a claim).
//
// Reply: {1} claimed; {2, fingerprint, response, µs until expiry} completed;
// {3, fingerprint, token, µs until the lease ends (≤ 0: ended)} in progress.
//
// A record in progress that already holds the claim's own token answers
// {1}: the claim was sent again (the client retries a command whose reply
// was lost) after it had won, and tokens are unique to one claim. Its lease
// starts again then, as if the claim had first run now: its holder has not
// started, and the first lease may have ended while the reply was lost, so
// that another request could take the key over as the holder starts.
const claimScript = scriptPrelude + `
local t = now()
local rec = redis.call('HMGET', KEYS[1], 'f', 't', 'l', 'r', 'e')
local fp, tok, lease, resp, exp = rec[1], rec[2], rec[3], rec[4], rec[5]
if fp then
  if resp then
    local left = tonumber(exp) - t
    if left > 0 then return {2, fp, resp, left} end
  elseif tok == ARGV[2] then
    local l = t + tonumber(ARGV[3])
    pexpire(l - t + tonumber(ARGV[4]))
    redis.call('HSET', KEYS[1], 'l', int(l))
    return {1}
  else
    local left = tonumber(lease) - t
    if not (ARGV[5] and tok == ARGV[5] and left <= 0) then
      return {3, fp, tok, left}
    end
  end
end
local l = t + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'f', ARGV[1], 't', ARGV[2], 'l', int(l))
redis.call('HDEL', KEYS[1], 'r', 'e', 'c')
pexpire(l - t + tonumber(ARGV[4]))
return {1}
`

// completeScript stores the response ARGV[2] in the record of KEYS[1], to
// be kept ARGV[3] µs, if it holds the token ARGV[1]. Reply: 1, or 0 when
// the token is not there. A record that token completed with that very
// response answers 1 too: the completion was sent again after its reply
// was lost. Any other completion of it answers 0.
const completeScript = scriptPrelude + `
local cur = redis.call('HMGET', KEYS[1], 't', 'c')
if cur[1] ~= ARGV[1] then
  if cur[2] == ARGV[1] and redis.call('HGET', KEYS[1], 'r') == ARGV[2] then return 1 end
  return 0
end
local ttl = tonumber(ARGV[3])
if ttl <= 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('HDEL', KEYS[1], 't', 'l')
redis.call('HSET', KEYS[1], 'r', ARGV[2], 'e', int(now() + ttl), 'c', ARGV[1])
pexpire(ttl)
return 1
`

// releaseScript deletes the record of KEYS[1] if it holds the token
// ARGV[1]. Reply: 1, or 0 when the token is not there.
const releaseScript = `
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
`

// extendScript moves the lease of KEYS[1] to end ARGV[2] µs from now, if
// the record holds the token ARGV[1], and its native expiry to the margin
// ARGV[3] µs after that. Reply: 1, or 0 when the token is not there.
const extendScript = scriptPrelude + `
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
local t = now()
local l = t + tonumber(ARGV[2])
pexpire(l - t + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'l', int(l))
return 1
`
