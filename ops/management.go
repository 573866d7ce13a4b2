package ops

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// ManagementCounts returns a StatusOptions.Counts that reads the queues of vhost from
// the RabbitMQ management HTTP API at baseURL (for example "http://broker:15672"),
// with HTTP basic authentication: GET /api/queues/<vhost>. The user needs the
// management (or monitoring) tag. client nil means http.DefaultClient. Credentials are
// sent in the Authorization header only, never in the URL or in errors.
func ManagementCounts(baseURL, user, password, vhost string, client *http.Client) func(ctx context.Context) (map[string]QueueCounts, error) {
	if client == nil {
		client = http.DefaultClient
	}
	return func(ctx context.Context) (map[string]QueueCounts, error) {
		endpoint := strings.TrimSuffix(baseURL, "/") + "/api/queues/" + url.PathEscape(vhost) +
			"?columns=name,messages,messages_ready,messages_unacknowledged"
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint, nil)
		if err != nil {
			return nil, fmt.Errorf("management api: %w", err)
		}
		req.SetBasicAuth(user, password)
		resp, err := client.Do(req)
		if err != nil {
			return nil, fmt.Errorf("management api: %w", err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("management api: GET /api/queues/%s: %s", url.PathEscape(vhost), resp.Status)
		}
		var queues []struct {
			Name     string `json:"name"`
			Messages int    `json:"messages"`
			Ready    int    `json:"messages_ready"`
			Unacked  int    `json:"messages_unacknowledged"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&queues); err != nil {
			return nil, fmt.Errorf("management api: decode queues: %w", err)
		}
		counts := make(map[string]QueueCounts, len(queues))
		for _, q := range queues {
			counts[q.Name] = QueueCounts{Messages: q.Messages, Ready: q.Ready, Unacked: q.Unacked}
		}
		return counts, nil
	}
}
