//go:build tools

// This file only pins, in this module's go.mod, what the watermill-amqp test packages
// that scripts/watermill-suite.sh runs import: the two majors, watermill's pub/sub test
// suite, testify, and the transport packages the overlay's subscriber wrapper calls.
package watermillsuite

import (
	_ "github.com/ThreeDotsLabs/watermill"
	_ "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	_ "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	_ "github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/ThreeDotsLabs/watermill/pubsub/tests"
	_ "github.com/stretchr/testify/assert"
	_ "github.com/stretchr/testify/require"

	_ "github.com/amqpretry/amqpretry"
	_ "github.com/amqpretry/amqpretry/wamqp2"
	_ "github.com/amqpretry/amqpretry/wamqp3"
)
