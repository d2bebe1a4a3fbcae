//go:build !race

package idemhttp

const raceEnabled = false
