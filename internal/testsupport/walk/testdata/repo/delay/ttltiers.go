package delay

func (*ttlTiers) Effective() {}

func (*ttlTiers) Park() {}
