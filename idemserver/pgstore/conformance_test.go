package pgstore

import (
	"testing"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/storetest"
)

func TestLeaseConformance(t *testing.T) {
	db := newTestDB(t, 20)
	storetest.Run(t, func(t *testing.T) idemserver.Store { return db.newStore(t) })
}

func TestLeaseHTTPConformance(t *testing.T) {
	db := newTestDB(t, 20)
	storetest.RunHTTP(t, func(t *testing.T) idemserver.Store { return db.newStore(t) })
}

func TestTransactionalConformance(t *testing.T) {
	db := newTestDB(t, 20)
	storetest.RunTransactional(t, func(t *testing.T) idemserver.Store { return db.newStore(t, WithTransactional()) })
}

func TestTransactionalHTTPConformance(t *testing.T) {
	db := newTestDB(t, 20)
	storetest.RunHTTP(t, func(t *testing.T) idemserver.Store { return db.newStore(t, WithTransactional()) })
}
