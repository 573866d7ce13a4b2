package middleware

func (*failureCounts) forget() {}
