package keys

func BrokerOwned() {}

func ParseAttempt() {}

func Reserved() {}
