package undecodable

func Is() {}
