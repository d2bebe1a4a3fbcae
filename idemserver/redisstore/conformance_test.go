package redisstore_test

import (
	"testing"

	"github.com/idemhttp/idemhttp/idemserver/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, newStore)
}

func TestHTTPConformance(t *testing.T) {
	storetest.RunHTTP(t, newStore)
}
