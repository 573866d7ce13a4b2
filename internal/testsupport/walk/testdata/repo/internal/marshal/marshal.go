package marshal

func (Marshaler) Marshal() {}

func (Options) UUIDKey() {}
