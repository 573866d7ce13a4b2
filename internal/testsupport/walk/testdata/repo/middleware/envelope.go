package middleware

func (Envelope) Write() {}

func ReadEnvelope() {}

func formatInt() {}

func formatTime() {}

func joinTypes() {}

func readTime() {}

func truncate() {}
