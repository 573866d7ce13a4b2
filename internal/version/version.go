// Package version reads RabbitMQ's version, once for the whole library, and says what
// each release can and cannot do that matters to retries.
package version

import (
	"cmp"
	"fmt"
	"regexp"
	"strconv"
)

// V is the leading major.minor.patch of a RabbitMQ version.
type V struct{ Major, Minor, Patch int }

var pattern = regexp.MustCompile(`^(\d+)\.(\d+)(?:\.(\d+))?`)

// Parse reads "3.13.7", "4.0.0-rc.1" or "4.3.6+2" (the suffix is ignored, a missing
// patch is 0).
func Parse(s string) (V, bool) {
	m := pattern.FindStringSubmatch(s)
	if m == nil {
		return V{}, false
	}
	n := func(s string) int { i, _ := strconv.Atoi(s); return i }
	return V{n(m[1]), n(m[2]), n(m[3])}, true
}

// AtLeast tells whether v is major.minor.patch or later.
func (v V) AtLeast(major, minor, patch int) bool {
	return cmp.Or(cmp.Compare(v.Major, major), cmp.Compare(v.Minor, minor), cmp.Compare(v.Patch, patch)) >= 0
}

// DelayedRetry tells whether version s has delayed retry for quorum queues (4.3+).
// An unknown version has not.
func DelayedRetry(s string) bool {
	v, ok := Parse(s)
	return ok && v.AtLeast(4, 3, 0)
}

// NoPlugins tells whether version s cannot run the delayed-message plugin (4.3+:
// metadata in Khepri only, the plugin needs Mnesia).
func NoPlugins(s string) bool { return DelayedRetry(s) }

// CountsNacks tells whether version s counts a basic.nack with requeue against a
// quorum queue's delivery limit, whose default is 20 from 4.0: 4.0 to 4.2 do (3.x has
// no default limit, 4.3 counts returns apart). An unknown version counts as 4.0.
func CountsNacks(s string) bool {
	v, ok := Parse(s)
	return !ok || v.Major == 4 && v.Minor < 3
}

// DeliveryLimit is the delivery limit RabbitMQ 4.0+ gives a quorum queue declared
// without x-delivery-limit: past it, a message is dead-lettered or dropped instead of
// delivered again. amqp1 keeps its own copy, pinned to this one by its tests.
const DeliveryLimit = 20

// DefaultDeliveryLimit tells whether version s gives every quorum queue a delivery
// limit of DeliveryLimit unless it declares one (4.0+; an unknown version counts as
// 4.0+).
func DefaultDeliveryLimit(s string) bool {
	v, ok := Parse(s)
	return !ok || v.AtLeast(4, 0, 0)
}

// Warning warns about a release that loses retries, or returns "": RabbitMQ 3.13.0 to
// 3.13.2, whose dead-letter cycle detection can drop a message that was rejected on the
// way (rabbitmq-server #11159, fixed in 3.13.3).
func Warning(s string) string {
	v, ok := Parse(s)
	if !ok || !v.AtLeast(3, 13, 0) || v.AtLeast(3, 13, 3) {
		return ""
	}
	return fmt.Sprintf("RabbitMQ %s: dead-letter cycle detection can drop dead-lettered messages, retries among them (rabbitmq-server #11159); upgrade to 3.13.3 or later", s)
}
