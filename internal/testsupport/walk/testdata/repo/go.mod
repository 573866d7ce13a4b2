module github.com/amqpretry/amqpretry

go 1.24.0
