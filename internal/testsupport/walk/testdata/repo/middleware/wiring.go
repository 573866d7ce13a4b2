package middleware

func (*retry) isBound() {}

func (*wiring) queue() {}

func parseMark() {}
