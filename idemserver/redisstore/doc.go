// Package redisstore is an [idemserver.Store] that keeps idempotency
// records in Redis, through github.com/redis/go-redis/v9, so that several
// instances of a service share them.
//
//	client := redis.NewClient(&redis.Options{
//		Addr:                  "localhost:6379",
//		ContextTimeoutEnabled: true, // see Timeouts
//	})
//	dedup := idemserver.Middleware(redisstore.New(client))
//
// # Timeouts
//
// The middleware bounds each store call with a deadline on its context
// ([idemserver.WithStoreTimeout], 5s by default), so that a Redis that
// stops answering without closing the connection (a failover, a dead NAT
// entry, a paused server) fails the call instead of holding the request.
// go-redis honours that deadline only when the client's
// ContextTimeoutEnabled option is set: without it, a command waits for
// ReadTimeout (3s by default, and the client may send it again, see
// MaxRetries) whatever the context says, and forever with ReadTimeout -1.
// Set
// ContextTimeoutEnabled on the client given to [New] (on a Cluster or
// failover client's options too); the client's own timeouts then still
// apply, the earlier of the two ending the call. A call that ends so is a
// store failure to the middleware: a claim is answered 503 without running
// the handler, and a Complete is sent again, which the store answers as
// the first if that one landed after all.
//
// # The model
//
// A record is one Redis string under one key, prefix "{scope:key}" (see
// [WithPrefix]), with ':', '%', '{' and '}' escaped inside the braces so
// that no two (scope, key) pairs share a Redis key. The braces make the
// pair the key's hash tag, and a record never spans two keys, so the store
// works unchanged on Redis Cluster (pass a *redis.ClusterClient). The
// string holds a small versioned layout: its state (in progress or
// completed), the request's fingerprint, the end of the lease or the
// record's expiry, the lease token, and once completed the response, in
// the versioned encoding the module's other shared stores use. A record of
// a layout version this release does not know, written by a later one, is
// neither replayed nor replaced: the store returns an error wrapping
// [ErrUnknownVersion], and the middleware answers 503 without running the
// handler. A key that holds anything else is neither replayed nor replaced
// either, and gets a 503 too: a string this store did not write, with an
// error wrapping [ErrUnexpectedReply], and another type (a hash, say),
// with Redis's WRONGTYPE error.
//
// Each method of the store is one round trip. A claim is one native
// command, SET with NX and GET (Redis 7.0 or later): it inserts an
// in-progress record unless one is there, and answers the record that was,
// so that a replay costs Redis about what a GET does and writes nothing.
// Complete, Release, Extend and TakeOver are Lua scripts, run by their
// SHA1 (EVALSHA), that compare the lease token inside the script, and
// TakeOver replaces a record only while its lease has ended, so a lease its
// holder just extended is not taken. The first call of a script on a
// server, and the first after the server restarted or its script cache was
// flushed (SCRIPT FLUSH), costs one more round trip: Redis answers NOSCRIPT
// and the store sends the script itself (EVAL), which loads it again. A
// claim and a replay need no script.
//
// A store's first claim, and its first after each [EvictionCheckInterval],
// takes one more, INFO memory (see "Eviction" below). Two rarer claims
// take a second round trip. A claim that finds a
// completed record expired by the middleware's clock but still in Redis
// (where the clocks of two instances differ) replaces it with the takeover
// script, as the Store contract treats an expired record as absent, unless
// Redis says it has much longer to run (see "One clock" below). And a
// Redis that refuses write commands while it still answers reads refuses
// SET even when NX would write nothing, for SET is a write command: full
// under maxmemory-policy noeviction (OOM), short of the replicas that
// min-replicas-to-write asks for (NOREPLICAS), after a failed save
// (MISCONF), or a replica (READONLY). The claim then reads the record with
// a GET, and a completed key still replays (see below).
//
// The store implements [idemserver.PackedStore], so a replay goes from the
// bytes Redis returns to the client without becoming an
// [idemserver.Response] in between.
//
// # One clock: the middleware's
//
// Leases and expiry are judged by the middleware's clock. A record holds
// the end of its lease, or its expiry, as an instant of that clock (the
// claim's LeaseExpires, the expiry given to Complete, the lease end given
// to Extend). A claim reports those instants, and the middleware compares
// them with the claim's Now; TakeOver's script compares the lease's end
// with the takeover's Now, sent along. SET NX GET cannot read the Redis
// server's clock, and the scripts read no instant of it.
//
// Redis's native expiry collects records (and, below, keeps a claim from
// replacing one early). It is given as a duration reckoned on the store's
// clock ([WithClock], which must be the middleware's; a claim stamped
// more than [MaxClockSkew] from it is refused with [ErrClockSkew]), and
// set later than the middleware's clock will judge the record ended: an
// in-progress record expires in Redis [LeaseMargin] after its lease ends
// (until then it shows the ended lease, which the middleware takes over,
// and which its holder may still extend or complete if no one took it
// over), and a completed one when its TTL ends. Nothing needs sweeping.
//
// Several instances share the records, and so compare their own clocks
// with instants another instance wrote. Keep their clocks synchronized
// (NTP). An instance whose clock is ahead by d sees every lease end d
// early, and completed records expire d early; taking such a lease over
// would run a live handler twice, and replacing such a record would run a
// retry again. So the two rare claims that replace a record (a takeover,
// and a claim of a completed record expired by its clock) ask Redis too:
// the record's native expiry is a duration its writer set, which Redis
// counts down whatever the instances' clocks say. When Redis says the
// lease or the record has more than 2×[MaxClockSkew] still to run, the
// claim fails with [ErrClocksDisagree] (the middleware answers 503, and
// reports it), and the record stays. An instance ahead by d therefore
// takes over a lease, or forgets a record, at most 2×MaxClockSkew early,
// whatever d is, or however its clock was stepped; since the middleware
// renews a lease a third of a lease after each renewal, a live handler
// is safe with a lease longer than 3×MaxClockSkew, 15 s (see
// [idemserver.WithLease]; the default is a minute). An instance whose
// clock is behind by d waits d longer to take over a crashed handler's
// key (within the margin, then Redis drops the record), and replays
// completed records until Redis lets them expire, on time.
//
// Redis keeps a native expiry as an instant of its own clock, so a step of
// the Redis host's clock forward deletes records early: a step past an
// in-progress record's margin ([LeaseMargin] after its lease) lets a
// retry run while the handler still runs, and one across a completed
// record's end lets a retry run again; a step back keeps records longer,
// and refuses takeovers with [ErrClocksDisagree] for as long. Keep that
// host's clock synchronized and slewed, not stepped, as well.
//
// go-redis sends a command again when a connection fails before its reply
// arrives. A claim or takeover that Redis ran, sent again, finds its own
// lease token and still reports the claim, with the lease it asked for:
// the middleware computed that lease's end before it first sent the claim,
// so its own reckoning is never later than the record's, and it does not
// run the handler when the answer comes after the lease ended. A
// completion sent again finds the record completed under its token (the
// record keeps it) with its response, and still reports success. A release
// sent again finds nothing of its own and reports [idemserver.ErrLeaseLost]
// to the middleware's observer, but changes nothing: the key is free, or
// claimed by another request, whose record it leaves alone.
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
//   - maxmemory-policy noeviction, or no maxmemory (see "Eviction"
//     below). With noeviction a full Redis refuses new claims (the
//     store's error wraps [idemserver.ErrStoreFull]), and the middleware
//     answers 503, while the claims it holds are still extended and
//     completed (a little past maxmemory: their scripts write PEXPIRE
//     first, which Redis lets through, and then every later write), and
//     completed keys replay (Redis refuses the claim's SET, and the store
//     reads the record with a GET: two round trips while Redis is full);
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
// again. [New] panics when given one.
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
//
// # Eviction
//
// Every record has a TTL, so a Redis with a maxmemory and any
// maxmemory-policy but noeviction (allkeys-lru, volatile-lru and the other
// allkeys-* and volatile-* ones) evicts live records when memory runs
// short, and tells no one. Managed services often default to such a policy
// (ElastiCache's is volatile-lru). The store therefore checks: it reads
// maxmemory and maxmemory_policy with INFO memory (on every primary of a
// Cluster) on its first claim, and again with the first claim after each
// [EvictionCheckInterval] by its clock, one claim checking while the others
// go on the last verdict (or, before the first, wait for it). While Redis
// may evict, or while the store cannot tell (INFO refused by an ACL, which
// puts it in @dangerous, or renamed), claims fail with an error wrapping
// [ErrEvictionPolicy] (and [idemserver.ErrStoreMisconfigured]) that says
// why and what to do, and the middleware answers 503 with Retry-After,
// saying the store refuses requests until its configuration is fixed,
// without running the handler, and reports the error to its observer.
// Claims held go on being extended, completed and released; a claim of a
// completed key is refused too, rather than replayed. A policy changed at
// runtime is caught at the next check, and so are its fix and a failover
// (Sentinel's, or a Cluster's) to a replica configured otherwise: in
// between, up to one interval, claims go on the last verdict, and a Redis
// made to evict in that window may do so unseen. The check is one more
// round trip (one per primary, sent together, on a Cluster) for the claim
// that makes it; between checks, a claim pays an atomic load for it. A
// check that cannot reach Redis decides nothing: its claim fails, and the
// next claim checks again. On a Cluster, a primary that is down counts with
// what it answered at the last check, so that the keys of the others can
// still be claimed; while one the store has never asked is down, claims
// fail.
//
// [WithEvictionAllowed] turns the check off, and never sends INFO: for an
// operator who accepts eviction, or cannot grant INFO. Records Redis
// evicts are then forgotten before their TTL, in silence.
package redisstore
