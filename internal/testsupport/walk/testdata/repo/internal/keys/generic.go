package keys

// Not from a trace: receivers of generic types, for TestFileOf.

func (*Set[K]) Add() {}

func (Pair[K, V]) Get() {}
