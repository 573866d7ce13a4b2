package brokertest

import (
	"context"
	"fmt"
	"time"
)

// RestartApp stops and starts the application of the broker under test (rabbitmqctl
// stop_app, start_app; each bounded as Ctl says) and waits, at most a minute, until it
// accepts AMQP connections again. start_app returns once the application has started,
// and the broker opens its listeners last, after it has restored its queues, exchanges
// and bindings. It returns how long the broker refused connections, from stop_app on.
// The caller must have called RequireRestart.
func RestartApp(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	for _, step := range []string{"stop_app", "start_app"} {
		if out, err := Ctl(ctx, step); err != nil {
			return 0, fmt.Errorf("%w\n%s", err, out)
		}
	}
	if err := Wait(time.Minute); err != nil {
		return 0, fmt.Errorf("the broker at AMQP_URI (%s) accepts no connection a minute after start_app: %w", Redact(URI()), err)
	}
	return time.Since(start), nil
}
