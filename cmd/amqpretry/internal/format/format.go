// Package format holds how the amqpretry command and its console write the figures
// they both show, so that a duration reads the same in a terminal and on the page.
package format

import (
	"fmt"
	"time"
)

// Duration formats d briefly: milliseconds under a second, tenths under a minute,
// seconds under a day, then days and minutes.
func Duration(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + Duration(-d)
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < 24*time.Hour:
		return d.Round(time.Second).String()
	}
	return fmt.Sprintf("%dd%s", d/(24*time.Hour), (d % (24 * time.Hour)).Round(time.Minute))
}
