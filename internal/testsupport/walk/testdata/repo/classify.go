package amqpretry

func DecisionOf() {}

func marks() {}
