package delay

func (delayedRetry) Effective() {}

func (delayedRetry) Settle() {}
