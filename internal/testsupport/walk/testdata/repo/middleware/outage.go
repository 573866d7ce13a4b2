package middleware

func (*engine) outageEdge() {}

func (*engine) outageOf() {}

func (*engine) runHandler() {}

func (*engine) runProbe() {}

func (*outage) add() {}

func (*outage) await() {}

func (*outage) record() {}

func (*outages) of() {}
