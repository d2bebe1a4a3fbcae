// Package redisstore is an [idemserver.Store] that keeps idempotency
// records in Redis, through github.com/redis/go-redis/v9, so that several
// instances of a service share them.
//
//	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	dedup := idemserver.Middleware(redisstore.New(client))
//
// # The model
//
// A record is one Redis hash under one key, prefix "{scope:key}" (see
// [WithPrefix]), with ':', '%', '{' and '}' escaped inside the braces so
// that no two (scope, key) pairs share a Redis key. The braces make the
// pair the key's hash tag, and a record never spans two keys, so the store
// works unchanged on Redis Cluster (pass a *redis.ClusterClient).
//
// Each method of the store is one round trip: a Lua script, run by its SHA1
// (EVALSHA). The first call of a script on a server, and the first after
// the server restarted or its script cache was flushed (SCRIPT FLUSH),
// costs one more: Redis answers NOSCRIPT and the store sends the script
// itself (EVAL), which loads it again. A claim answers every outcome at
// once: claimed, in progress (with the lease's token and end) or completed
// (with the stored response, in the versioned encoding the module's other
// shared stores use). Complete, Release, Extend and TakeOver compare the
// lease token inside their script, and TakeOver replaces a record only
// while its lease has ended, so a lease its holder just extended is not
// taken.
//
// # One clock: the Redis server's
//
// Leases and expiry are judged by the clock of the Redis server, read with
// TIME inside each script, and by no other. The store sends durations, not
// instants: a claim's lease lasts Claim.LeaseExpires minus Claim.Now, and
// the expiry given to Complete (or the lease end given to Extend) lies as
// far in the future as it does on the store's clock, the middleware's (see
// [WithClock]). The times a claim reports are the claim's Now plus what the
// server says is left, so the middleware, comparing them with Now, agrees
// with the server about which leases have ended. Instances with skewed
// clocks therefore agree too. Redis 5 or later is needed, for scripts that
// read TIME and then write.
//
// Expiry is Redis's own: an in-progress record expires in Redis
// [LeaseMargin] after its lease ends (until then it reports the ended lease,
// which the middleware takes over), and a completed one when its TTL ends.
// Nothing needs sweeping.
//
// go-redis sends a command again when a connection fails before its reply
// arrives. A claim or takeover that Redis ran, sent again, finds its own
// lease token and still reports the claim, with the lease started again
// (the first may have ended while the reply was lost); a completion sent again finds
// the record completed under its token (the record keeps it) with its
// response, and still reports success. A release sent again finds nothing of its own and
// reports [idemserver.ErrLeaseLost] to the middleware's observer, but
// changes nothing: the key is free, or claimed by another request, whose
// record it leaves alone.
//
// # What Redis does not give
//
// The records are not atomic with the handler's own writes. The handler
// writes to its database, and then the store completes the record in
// Redis: a crash, or Redis being unreachable, between the two leaves the
// record in progress, and once its lease ends a retry runs the handler
// again. When the handler's effect is a write to PostgreSQL and must happen
// once even then, use the transactional mode of idemserver/pgstore, which
// commits the claim, the handler's writes and the response in one
// transaction; or make the handler's own write idempotent on the key (a
// unique constraint on it).
//
// A record survives a restart of Redis only as far as Redis persists it.
// With the default configuration of many deployments (snapshots only, or no
// persistence), a restart forgets every record since the last snapshot.
// Configure:
//
//   - appendonly yes, so that every write is logged;
//   - appendfsync always, to lose nothing a client was answered, at the
//     cost of an fsync per write (batched across clients); or appendfsync
//     everysec (Redis's default), where a crash of the machine or a power
//     loss loses up to about the last two seconds of records, and a crash of
//     the Redis process alone usually nothing (Redis writes the log before
//     it replies, unless a slow disk makes it postpone the write).
//     appendfsync no leaves the flush to the kernel: tens of seconds;
//   - maxmemory-policy noeviction. Every record has a TTL, so the volatile-*
//     and allkeys-* policies would evict live records in silence; with
//     noeviction a full Redis refuses new claims, and the middleware
//     answers 503, while the claims it holds are still extended and
//     completed (a little past maxmemory), and completed keys replay;
//   - replication is asynchronous: a failover to a replica can lose the last
//     writes the primary acknowledged.
//
// When Redis loses records anyway, a retry of a completed key finds nothing
// and runs the handler again; a retry of a key in progress claims it and
// runs the handler beside the one still running, whose completion then
// fails with [idemserver.ErrLeaseLost]. A claim that Redis kept but could
// not answer (it went down in between) got 503, and leaves its key in
// progress until the lease ends.
//
// Not a Ring: a *redis.Ring moves the keys of a shard it finds down to the
// other shards, and back when the shard returns, so records vanish and
// reappear, and a retry of a completed or running key runs the handler
// again.
//
// While Redis is down or slow, Claim returns an error and the middleware
// answers 503 with Retry-After without running the handler. How long that
// takes is the client's: go-redis retries a failed command (MaxRetries,
// DialerRetries, their backoff and timeouts) before giving up, and unless
// its ContextTimeoutEnabled option is set it waits for a reply for
// ReadTimeout whatever the request's context says. Once as many dials as
// its pool holds connections have failed, it answers the last dial error
// without dialing until a probe it sends once a second gets through: the
// 503s last up to a second after Redis is back.
package redisstore
