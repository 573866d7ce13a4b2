module github.com/amqpretry/amqpretry/pgdedup

go 1.24.0

require (
	github.com/ThreeDotsLabs/watermill v1.5.1
	github.com/amqpretry/amqpretry v0.0.0-00010101000000-000000000000
	github.com/lib/pq v1.10.9
)

require (
	github.com/cenkalti/backoff/v4 v4.3.0 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/lithammer/shortuuid/v3 v3.0.7 // indirect
	github.com/oklog/ulid v1.3.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/rabbitmq/amqp091-go v1.10.0 // indirect
	github.com/sony/gobreaker v1.0.0 // indirect
)

replace github.com/amqpretry/amqpretry => ../
