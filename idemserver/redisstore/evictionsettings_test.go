package redisstore

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestEvictionSettings(t *testing.T) {
	// The text of INFO memory as Redis sends it (CRLF lines, a "# Memory"
	// header, maxmemory_human beside maxmemory), in any order, and as a
	// proxy in front of several servers may send it: a section per server,
	// one after the other. A reply that holds several sections may evict
	// when any of them may: the last one's settings must not speak for
	// the others.
	info := func(lines ...string) string { return strings.Join(lines, "\r\n") + "\r\n" }
	for _, tt := range []struct {
		name   string
		info   string
		evicts bool
		ok     bool
	}{
		{"no maxmemory", info("# Memory", "used_memory:1000", "maxmemory:0", "maxmemory_human:0B", "maxmemory_policy:allkeys-lru"), false, true},
		{"noeviction", info("# Memory", "maxmemory:104857600", "maxmemory_human:100.00M", "maxmemory_policy:noeviction"), false, true},
		{"evicts", info("# Memory", "maxmemory:104857600", "maxmemory_human:100.00M", "maxmemory_policy:volatile-lru"), true, true},
		{"policy first", info("maxmemory_policy:allkeys-lfu", "maxmemory_human:1.00M", "maxmemory:1048576"), true, true},
		{"LF lines", strings.ReplaceAll(info("maxmemory:1048576", "maxmemory_policy:allkeys-lru"), "\r", ""), true, true},
		{"no policy", info("maxmemory:1048576"), false, false},
		{"no maxmemory line", info("maxmemory_human:1.00M", "maxmemory_policy:allkeys-lru"), false, false},
		{"maxmemory with a unit", info("maxmemory:1mb", "maxmemory_policy:allkeys-lru"), false, false},
		{"second section evicts", info("# Memory", "maxmemory:0", "maxmemory_policy:noeviction", "# Memory", "maxmemory:1048576", "maxmemory_policy:allkeys-lru"), true, true},
		{"first section evicts", info("# Memory", "maxmemory:1048576", "maxmemory_policy:allkeys-lru", "# Memory", "maxmemory:0", "maxmemory_policy:noeviction"), true, true},
		{"first section evicts, second noeviction", info("# Memory", "maxmemory:1048576", "maxmemory_policy:volatile-ttl", "# Memory", "maxmemory:1048576", "maxmemory_policy:noeviction"), true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			maxmemory, policy, ok := evictionSettings(tt.info)
			assert.Equal(t, tt.ok, ok)
			if ok {
				assert.Equal(t, tt.evicts, maxmemory > 0 && policy != "noeviction", "maxmemory %d, policy %q", maxmemory, policy)
			}
		})
	}
}
