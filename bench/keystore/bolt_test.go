// Package keystore compares the durable key stores idemhttp could use, on
// the work of BenchmarkFileKeyStorePairs in the idemhttp package: a durable
// record and a durable release per operation, from 1, 8 and 64 goroutines.
package keystore

import (
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/idemhttp/idemhttp/internal/benchpairs"
)

var bucket = []byte("pending")

// BenchmarkBoltPairs records and releases each key in its own Update
// transaction, with bbolt's default durability (an fdatasync per commit).
// BenchmarkBoltBatchPairs uses DB.Batch, bbolt's own group commit, which
// coalesces concurrent transactions into one commit.
func BenchmarkBoltPairs(b *testing.B)      { benchBolt(b, (*bolt.DB).Update) }
func BenchmarkBoltBatchPairs(b *testing.B) { benchBolt(b, (*bolt.DB).Batch) }

func benchBolt(b *testing.B, commit func(*bolt.DB, func(*bolt.Tx) error) error) {
	for _, g := range benchpairs.Goroutines {
		b.Run(benchpairs.Name(g), func(b *testing.B) {
			db, err := bolt.Open(filepath.Join(b.TempDir(), "keys.db"), 0o600, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer db.Close()
			if err := db.Update(func(tx *bolt.Tx) error {
				_, err := tx.CreateBucket(bucket)
				return err
			}); err != nil {
				b.Fatal(err)
			}
			benchpairs.Run(b, g, func(i int) error {
				op := []byte(benchpairs.Operation(i))
				key := []byte(benchpairs.Key(i))
				err := commit(db, func(tx *bolt.Tx) error {
					bk := tx.Bucket(bucket)
					if bk.Get(op) != nil {
						return nil
					}
					return bk.Put(op, key)
				})
				if err != nil {
					return err
				}
				return commit(db, func(tx *bolt.Tx) error { return tx.Bucket(bucket).Delete(op) })
			})
		})
	}
}
