package idemserver_test

import (
	"testing"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/storetest"
)

func newMemoryStore(t *testing.T) idemserver.Store {
	s := idemserver.NewMemoryStore()
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestMemoryStoreConformance(t *testing.T) {
	storetest.Run(t, newMemoryStore)
}

func TestMemoryStoreHTTPConformance(t *testing.T) {
	storetest.RunHTTP(t, newMemoryStore)
}
