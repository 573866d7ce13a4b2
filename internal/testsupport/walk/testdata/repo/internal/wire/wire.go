package wire

func Size() {}

func fieldSize() {}
