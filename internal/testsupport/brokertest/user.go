package brokertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// RestrictedUser adds a RabbitMQ user with read and write but no configure permission
// on the vhost of the test broker (an application run in topology mode verify), deleted
// when the test ends, and returns the broker's URI with its credentials. It needs
// rabbitmqctl (CtlCommand): without one it skips the test, or fails it under CI=true.
func RestrictedUser(t testing.TB) string {
	t.Helper()
	Dial(t)
	words := CtlCommand()
	if _, err := exec.LookPath(words[0]); err != nil {
		if CI() {
			t.Fatalf("needs %s to create a user: %v", words[0], err)
		}
		t.Skipf("needs %s to create a user: %v", words[0], err)
	}
	u, err := url.Parse(URI())
	if err != nil {
		t.Fatal(err)
	}
	vhost := strings.TrimPrefix(u.Path, "/")
	if vhost == "" {
		vhost = "/"
	}
	user, pass := "amqpretry-restricted-"+randomHex(6), randomHex(12)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if out, err := Ctl(ctx, "add_user", user, pass); err != nil {
		if CI() {
			t.Fatalf("add_user: %v\n%s", err, out)
		}
		t.Skipf("rabbitmqctl does not reach the broker: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if out, err := Ctl(ctx, "delete_user", user); err != nil {
			t.Errorf("delete user %s: %v\n%s", user, err, out)
		}
	})
	if out, err := Ctl(ctx, "set_permissions", "-p", vhost, user, "^$", ".*", ".*"); err != nil {
		t.Fatalf("set_permissions: %v\n%s", err, out)
	}
	u.User = url.UserPassword(user, pass)
	return u.String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
