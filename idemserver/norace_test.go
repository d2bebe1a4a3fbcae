//go:build !race

package idemserver

const raceEnabled = false
