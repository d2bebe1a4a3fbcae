package idemserver

// Test helpers of this package, for the tests of package idemserver_test.
type FakeClock = fakeClock

var NewFakeClock = newFakeClock
