package middleware

func (*chain) Value() {}

func (*chain) join() {}

func (*engine) Middleware() {}

func (*engine) read() {}

func chainOf() {}
