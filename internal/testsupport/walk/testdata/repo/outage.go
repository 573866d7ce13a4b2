package amqpretry

func breakerOpen() {}
