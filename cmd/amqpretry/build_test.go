package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestPlainGoBuild (issue 51): `go build` in this directory failed ("missing go.sum
// entry ... go mod download github.com/amqpretry/amqpretry", which then failed with
// 403: the module proxy has no version of the library); only go.sh built it. Plain go,
// with no GOWORK of go.sh's, builds it through the committed go.work.
func TestPlainGoBuild(t *testing.T) {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "GOWORK=") })
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	goEnv := exec.Command("go", "env", "GOWORK")
	goEnv.Env = env
	out, err := goEnv.Output()
	if want := filepath.Join(wd, "go.work"); err != nil || strings.TrimSpace(string(out)) != want {
		t.Errorf("go env GOWORK in %s = %q (%v), want %s", wd, strings.TrimSpace(string(out)), err, want)
	}
	build := exec.Command("go", "build", "-o", filepath.Join(t.TempDir(), "amqpretry"), ".")
	build.Env = env
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build in %s: %v\n%s", wd, err, out)
	}
}
