package middleware

func (*engine) observe() {}
