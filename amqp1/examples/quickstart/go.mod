module github.com/amqpretry/amqpretry/amqp1/examples/quickstart

go 1.25

require (
	github.com/ThreeDotsLabs/watermill v1.5.1
	github.com/amqpretry/amqpretry v0.0.0-00010101000000-000000000000
	github.com/amqpretry/amqpretry/amqp1 v0.0.0-00010101000000-000000000000
	github.com/rabbitmq/amqp091-go v1.10.0
)

require (
	github.com/Azure/go-amqp v1.7.0 // indirect
	github.com/cenkalti/backoff/v4 v4.3.0 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/lithammer/shortuuid/v3 v3.0.7 // indirect
	github.com/oklog/ulid v1.3.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/sony/gobreaker v1.0.0 // indirect
)

// Build against the library and module amqp1 of this checkout. In a module of your
// own, require released versions instead and drop these lines.
replace (
	github.com/amqpretry/amqpretry => ../../..
	github.com/amqpretry/amqpretry/amqp1 => ../..
)
