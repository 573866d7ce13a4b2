// Package testsupport contains the test harness only: the packages and programs under it
// (brokertest, gluetest, noloss, tlstest, and the modules of their own netdelay and
// watermillsuite) are imported by tests and test programs, and may import any package
// of the module. Nothing outside tests imports them.
//
// The other packages directly under internal/ import nothing above internal/ but the
// lower leaf packages topology and xdeath; internal/wamqp, the 0-9-1 transport the
// transport packages share, is the one exception. scripts/test.sh checks it.
package testsupport
