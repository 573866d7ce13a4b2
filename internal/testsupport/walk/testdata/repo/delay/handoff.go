package delay

func (*pubChannel) takeReturn() {}

func (*publisher) Publish() {}

func (*publisher) channel() {}

func (*publisher) publish() {}

func fitsFrame() {}
