package retry

import "time"

// HandoffPause is the pause after the n-th failed hand-off of a message in a row (1 is
// the first): what the README's figures about the hand-off's pacing are checked against.
func HandoffPause(n int) time.Duration { return handoffBackoff(n) }
