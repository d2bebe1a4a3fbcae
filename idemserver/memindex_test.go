package idemserver

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// The index agrees with a map through random adds and removes, with hashes
// from a small set so that runs form, collide, wrap around the end of the
// table and grow it.
func TestMemIndexAgreesWithMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var x memIndex
	want := map[int32]uint64{} // slot -> hash
	slots := func(h uint64) map[int32]bool {
		found := map[int32]bool{}
		if x.n == 0 {
			return found
		}
		tag := indexTag(h)
		for p := x.home(tag); x.entries[p] != 0; p = (p + 1) & x.mask() {
			if e := x.entries[p]; uint32(e>>32) == tag {
				found[int32(uint32(e))-1] = true
			}
		}
		return found
	}
	next := int32(0)
	for step := range 20000 {
		if len(want) > 0 && rng.IntN(2) == 0 {
			for slot, h := range want { // a random one, as map order goes
				x.remove(h, slot)
				delete(want, slot)
				break
			}
		} else {
			// Tags near the top wrap around the end of small tables.
			h := uint64(rng.IntN(40)+(1<<32-20)) << 32
			x.add(h, next)
			want[next] = h
			next++
		}
		require.Equal(t, len(want), x.n, "step %d", step)
		if step%97 == 0 {
			for slot, h := range want {
				require.True(t, slots(h)[slot], "step %d: slot %d not found", step, slot)
			}
			require.LessOrEqual(t, 2*x.n, len(x.entries))
			held := 0
			for _, e := range x.entries {
				if e != 0 {
					held++
					h, ok := want[int32(uint32(e))-1]
					require.True(t, ok, "step %d: removed slot still indexed", step)
					require.Equal(t, indexTag(h), uint32(e>>32))
				}
			}
			require.Equal(t, x.n, held)
		}
	}
}
