module github.com/amqpretry/amqpretry/cmd/amqpretry

go 1.25.0

require (
	github.com/amqpretry/amqpretry v0.0.0-00010101000000-000000000000
	github.com/chromedp/chromedp v0.23.0
	github.com/creack/pty v1.1.24
	github.com/rabbitmq/amqp091-go v1.10.0
	github.com/schollz/progressbar/v3 v3.19.1
	github.com/spf13/cobra v1.10.2
	github.com/spf13/pflag v1.0.9
	golang.org/x/term v0.44.0
)

require (
	github.com/ThreeDotsLabs/watermill v1.5.1 // indirect
	github.com/chromedp/cdproto v0.159.0 // indirect
	github.com/go-json-experiment/json v0.0.0-20260213210345-44df1a37e875 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/lithammer/shortuuid/v3 v3.0.7 // indirect
	github.com/mitchellh/colorstring v0.0.0-20190213212951-d06e56a500db // indirect
	github.com/oklog/ulid v1.3.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/rivo/uniseg v0.4.7 // indirect
	golang.org/x/sys v0.46.0 // indirect
)
