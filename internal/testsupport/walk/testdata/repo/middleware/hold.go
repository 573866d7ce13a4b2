package middleware

func (*engine) holdDelivery() {}

func (*engine) settle() {}

func (*heldRetries) add() {}
