package marshal

func CopyContext() {}
