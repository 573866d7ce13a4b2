package middleware

import (
	"strings"
	"testing"
	"time"
)

func TestPolicyDelay(t *testing.T) {
	tests := []struct {
		name   string
		policy Policy
		want   []time.Duration // delay after attempts 1, 2, 3, ...
	}{
		{
			name:   "defaults without jitter double from 1s",
			policy: Policy{NoJitter: true},
			want:   []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second},
		},
		{
			name:   "multiplier 1.5 keeps its fraction",
			policy: Policy{InitialInterval: time.Second, Multiplier: 1.5, NoJitter: true},
			want:   []time.Duration{time.Second, 1500 * time.Millisecond, 2250 * time.Millisecond, 3375 * time.Millisecond},
		},
		{
			name:   "capped by MaxInterval",
			policy: Policy{InitialInterval: 100 * time.Millisecond, Multiplier: 10, MaxInterval: 5 * time.Second, NoJitter: true},
			want:   []time.Duration{100 * time.Millisecond, time.Second, 5 * time.Second, 5 * time.Second},
		},
		{
			name:   "explicit delays, last repeats",
			policy: Policy{Delays: []time.Duration{time.Second, time.Minute}},
			want:   []time.Duration{time.Second, time.Minute, time.Minute},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.policy
			p.setDefaults()
			if err := p.Validate(); err != nil {
				t.Fatal(err)
			}
			for i, want := range tt.want {
				if got := p.Delay(i + 1); got != want {
					t.Errorf("Delay(%d) = %s, want %s", i+1, got, want)
				}
			}
		})
	}
}

func TestPolicyJitterStaysInBounds(t *testing.T) {
	p := Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: 3 * time.Second, Jitter: 0.5}
	p.setDefaults()
	seen := map[time.Duration]bool{}
	for range 200 {
		d := p.Delay(1)
		if d < 500*time.Millisecond || d > 1500*time.Millisecond {
			t.Fatalf("Delay(1) = %s, outside 1s ± 50%%", d)
		}
		seen[d] = true
		if d := p.Delay(5); d > 3*time.Second {
			t.Fatalf("Delay(5) = %s, above MaxInterval 3s", d)
		}
	}
	if len(seen) < 10 {
		t.Fatalf("jitter produced only %d distinct delays in 200 draws", len(seen))
	}
}

func TestPolicyValidateNamesTheField(t *testing.T) {
	tests := []struct {
		policy Policy
		field  string
	}{
		{Policy{MaxAttempts: -1}, "MaxAttempts"},
		{Policy{Delays: []time.Duration{time.Second, -time.Second}}, "Delays[1]"},
		{Policy{InitialInterval: -time.Second}, "InitialInterval"},
		{Policy{Multiplier: 0.5}, "Multiplier"},
		{Policy{InitialInterval: time.Minute, MaxInterval: time.Second}, "MaxInterval"},
		{Policy{Jitter: 1.5}, "Jitter"},
		{Policy{Jitter: -0.1}, "Jitter"},
	}
	for _, tt := range tests {
		t.Run(tt.field, func(t *testing.T) {
			p := tt.policy
			p.setDefaults()
			err := p.Validate()
			if err == nil || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("Validate() = %v, want an error naming %s", err, tt.field)
			}
		})
	}
}
