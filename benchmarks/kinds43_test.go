package main

import (
	"slices"
	"strings"
	"testing"
)

func TestParseKinds43(t *testing.T) {
	if k, err := parseKinds43(""); k != nil || err != nil {
		t.Fatalf(`parseKinds43(""): %v, %v; want nil, nil (every default kind)`, k, err)
	}
	k, err := parseKinds43("raw, ttl-tiers/storm,ceiling-lean/storm")
	if err != nil || !slices.Equal(k, []string{"raw", "ttl-tiers/storm", "ceiling-lean/storm"}) {
		t.Fatalf("parseKinds43: %v, %v", k, err)
	}
	if _, err := parseKinds43("ttl-tiers/strom"); err == nil || !strings.Contains(err.Error(), `"ttl-tiers/strom"`) || !strings.Contains(err.Error(), "ttl-tiers/storm") {
		t.Fatalf("an unknown kind: %v; want a refusal naming it and the known kinds", err)
	}
}
