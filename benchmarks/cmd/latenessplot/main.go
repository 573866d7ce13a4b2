// Command latenessplot draws the amqpretry_redelivery_lateness_seconds histogram of
// Prometheus text dumps (the metrics example's output) as one bar group per bucket and
// one bar per backend. It lives in the benchmarks module so that its plotting
// dependency stays out of the library's and the metrics module's.
//
//	go run ./cmd/latenessplot -o ../metrics/results/lateness.png ../metrics/results/*.prom
package main

import (
	"bufio"
	"flag"
	"fmt"
	"image/color"
	"os"
	"regexp"
	"sort"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

var bucketLine = regexp.MustCompile(`^amqpretry_redelivery_lateness_seconds_bucket\{backend="([^"]+)",le="([^"]+)"\} (\d+)`)

// series is one backend's cumulative bucket counts by upper bound.
type series struct {
	backend string
	les     []string
	counts  []float64 // per bucket, not cumulative
}

func read(path string) ([]series, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	byBackend := map[string]*series{}
	var order []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		m := bucketLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		s, ok := byBackend[m[1]]
		if !ok {
			s = &series{backend: m[1]}
			byBackend[m[1]] = s
			order = append(order, m[1])
		}
		n, _ := strconv.ParseFloat(m[3], 64)
		s.les = append(s.les, m[2])
		s.counts = append(s.counts, n)
	}
	var out []series
	for _, b := range order {
		s := byBackend[b]
		for i := len(s.counts) - 1; i > 0; i-- { // cumulative to per bucket
			s.counts[i] -= s.counts[i-1]
		}
		out = append(out, *s)
	}
	return out, sc.Err()
}

func main() {
	out := flag.String("o", "lateness.png", "PNG to write")
	title := flag.String("title", "Redelivery lateness (amqpretry_redelivery_lateness_seconds)", "plot title")
	flag.Parse()
	var all []series
	for _, path := range flag.Args() {
		s, err := read(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		all = append(all, s...)
	}
	if len(all) == 0 {
		fmt.Fprintln(os.Stderr, "no lateness histogram in the files given")
		os.Exit(1)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].backend < all[j].backend })
	p := plot.New()
	p.Title.Text = *title
	p.X.Label.Text = "arrival minus due time, bucket upper bound (s)"
	p.Y.Label.Text = "retries"
	colors := []color.Color{color.RGBA{R: 31, G: 119, B: 180, A: 255}, color.RGBA{R: 255, G: 127, B: 14, A: 255}, color.RGBA{R: 44, G: 160, B: 44, A: 255}}
	width := vg.Points(14)
	for i, s := range all {
		bars, err := plotter.NewBarChart(plotter.Values(s.counts), width)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		bars.Color = colors[i%len(colors)]
		bars.LineStyle.Width = 0
		bars.Offset = vg.Length(float64(i)-float64(len(all)-1)/2) * width
		p.Add(bars)
		p.Legend.Add(s.backend, bars)
		p.NominalX(s.les...)
	}
	p.Legend.Top = true
	if err := p.Save(10*vg.Inch, 5*vg.Inch, *out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
