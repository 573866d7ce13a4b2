//go:build !race

package gluetest

const raceEnabled = false
