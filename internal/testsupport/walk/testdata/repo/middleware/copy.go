package middleware

func (*engine) checkWiring() {}

func (*engine) decide() {}

func (*engine) envelope() {}

func (*engine) fail() {}

func (*engine) holdsRetry() {}

func (*engine) scheduled() {}

func (*failure) log() {}

func copyOf() {}

func delayOf() {}

func errorTypes() {}
