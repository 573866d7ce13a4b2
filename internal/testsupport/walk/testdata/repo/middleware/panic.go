package middleware

func (*engine) run() {}

func stackOf() {}
