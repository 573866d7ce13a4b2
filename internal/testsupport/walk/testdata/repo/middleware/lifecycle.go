package middleware

func (*lifecycle) begin() {}

func (*lifecycle) closing() {}
