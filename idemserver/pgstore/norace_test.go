//go:build !race

package pgstore

const raceEnabled = false
