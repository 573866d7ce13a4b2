package main

import (
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plotReport draws four panels into one PNG: lateness per backend, head-of-line
// lateness, throughput under failure (ours, in-process, no failures) and the retry
// path against the raw loop. A panel whose scenario did not run says so.
func plotReport(path string, r *report) error {
	panels := [][]*plot.Plot{{latenessPlot(r), headOfLinePlot(r)}, {throughputPlot(r), retryPathPlot(r)}}
	for _, row := range panels {
		for _, p := range row {
			if p == nil {
				continue
			}
			p.Title.TextStyle.Font.Size = vg.Points(13)
			p.X.Label.TextStyle.Font.Size = vg.Points(11)
			p.Y.Label.TextStyle.Font.Size = vg.Points(11)
			p.X.Tick.Label.Font.Size = vg.Points(10)
			p.Y.Tick.Label.Font.Size = vg.Points(10)
		}
	}
	img := vgimg.NewWith(vgimg.UseWH(16*vg.Inch, 10*vg.Inch), vgimg.UseDPI(96))
	dc := draw.New(img)
	title := fmt.Sprintf("amqpretry benchmarks, %s mode, RabbitMQ %s, %d CPUs", r.mode, r.broker, numCPU())
	dc.FillText(draw.TextStyle{Color: color.Black, Font: font.From(plot.DefaultFont, 15), Handler: plot.DefaultTextHandler, XAlign: draw.XCenter},
		vg.Point{X: 8 * vg.Inch, Y: 10*vg.Inch - 18}, title)
	body := draw.Crop(dc, 0, 0, 0, -26)
	tiles := draw.Tiles{Rows: 2, Cols: 2, PadX: vg.Inch / 2, PadY: vg.Inch / 2, PadTop: vg.Inch / 8, PadBottom: vg.Inch / 8, PadLeft: vg.Inch / 8, PadRight: vg.Inch / 4}
	canvases := plot.Align(panels, tiles, body)
	for i := range panels {
		for j := range panels[i] {
			panels[i][j].Draw(canvases[i][j])
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, // blue
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}, // orange
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, // green
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, // red
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff}, // purple
}

func notMeasured(title string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title + " (not measured in this run)"
	p.HideAxes()
	return p
}

// floorLog keeps a value drawable on a log axis (a retry can be early or 0 ms late).
const floorLog = 0.1

func logY(p *plot.Plot) {
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
}

func goalLine(p *plot.Plot, y float64, label string, c color.Color) {
	f := plotter.NewFunction(func(float64) float64 { return y })
	f.Color = c
	f.Dashes = []vg.Length{vg.Points(6), vg.Points(4)}
	f.Width = vg.Points(1)
	p.Add(f)
	p.Legend.Add(label, f)
}

func latenessPlot(r *report) *plot.Plot {
	const title = "Lateness of 1-10 s retries (arrival - due), per backend"
	if len(r.lateness) == 0 {
		return notMeasured(title)
	}
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = "ms late (log scale)"
	logY(p)
	var names []string
	for _, l := range r.lateness {
		names = append(names, l.name)
	}
	for _, name := range r.latenessSkipped {
		names = append(names, name+"\n(skipped: cannot be\nbuilt on this broker)")
	}
	series := []struct {
		name  string
		get   func(quantiles) float64
		shape draw.GlyphDrawer
	}{
		{"p50", func(q quantiles) float64 { return q.P50 }, draw.CircleGlyph{}},
		{"p95", func(q quantiles) float64 { return q.P95 }, draw.SquareGlyph{}},
		{"p99", func(q quantiles) float64 { return q.P99 }, draw.TriangleGlyph{}},
		{"max", func(q quantiles) float64 { return q.Max }, draw.CrossGlyph{}},
	}
	for k, s := range series {
		xys := make(plotter.XYs, len(r.lateness))
		for i, l := range r.lateness {
			xys[i] = plotter.XY{X: float64(i) + 0.12*float64(k) - 0.18, Y: math.Max(s.get(l.d.q), floorLog)}
		}
		sc, err := plotter.NewScatter(xys)
		if err != nil {
			continue
		}
		sc.GlyphStyle = draw.GlyphStyle{Color: palette[k], Radius: vg.Points(4), Shape: s.shape}
		p.Add(sc)
		p.Legend.Add(s.name, sc)
		if s.name == "p99" { // labelled right of the max marker
			labels := make([]string, len(xys))
			at := make(plotter.XYs, len(xys))
			for i, l := range r.lateness {
				labels[i] = fmt.Sprintf("p99 %.0f ms", l.d.q.P99)
				at[i] = plotter.XY{X: xys[i].X + 0.12, Y: xys[i].Y}
			}
			if lb, err := plotter.NewLabels(plotter.XYLabels{XYs: at, Labels: labels}); err == nil {
				lb.Offset = vg.Point{X: vg.Points(8), Y: vg.Points(-4)}
				p.Add(lb)
			}
		}
	}
	goalLine(p, 100, "goal p99 100 ms (ttl-tiers, delayed-exchange)", palette[3])
	goalLine(p, 1000, "goal p99 1 s (binary-levels)", palette[4])
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.6, float64(len(names))-0.4
	p.Y.Min = math.Max(floorLog, math.Min(p.Y.Min/2, 1))
	p.Y.Max = math.Max(p.Y.Max*3, 5000)
	p.Legend.Top = true
	return p
}

func headOfLinePlot(r *report) *plot.Plot {
	const title = "Head of line: a 1 s retry behind 1,000 long ones"
	if len(r.headOfLine) == 0 {
		return notMeasured(title)
	}
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = "ms late (log scale)"
	logY(p)
	names := make([]string, len(r.headOfLine))
	xys := make(plotter.XYs, len(r.headOfLine))
	labels := make([]string, len(r.headOfLine))
	for i, v := range r.headOfLine {
		names[i] = v.name
		if v.name == baselineKey(r.sz.baselineDelay) {
			names[i] = fmt.Sprintf("baseline: 1 per-msg-TTL queue\n(behind %d x %s)", r.sz.holLong, tierName(r.sz.baselineDelay))
		} else {
			names[i] = fmt.Sprintf("%s\n(behind %d x %s)", v.name, r.sz.holLong, tierName(r.sz.holLongDelay))
		}
		xys[i] = plotter.XY{X: float64(i), Y: math.Max(v.value, floorLog)}
		labels[i] = fmt.Sprintf("%.0f ms", v.value)
	}
	sc, err := plotter.NewScatter(xys)
	if err == nil {
		sc.GlyphStyle = draw.GlyphStyle{Color: palette[0], Radius: vg.Points(5), Shape: draw.CircleGlyph{}}
		p.Add(sc)
	}
	if lb, err := plotter.NewLabels(plotter.XYLabels{XYs: xys, Labels: labels}); err == nil {
		lb.Offset = vg.Point{X: vg.Points(8), Y: vg.Points(-4)}
		p.Add(lb)
	}
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.3
	p.Y.Min = math.Max(floorLog, p.Y.Min/3)
	p.Y.Max *= 5
	return p
}

// barSeries is one colour of a grouped bar chart: a value per category.
type barSeries struct {
	name   string
	values []float64
}

func bars(title, ylabel string, categories []string, series []barSeries, format string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = ylabel
	width := vg.Points(150 / float64(len(series)+1))
	for k, s := range series {
		b, err := plotter.NewBarChart(plotter.Values(s.values), width)
		if err != nil {
			continue
		}
		offset := (float64(k) - float64(len(series)-1)/2) * float64(width)
		b.Offset = vg.Length(offset)
		b.Color = palette[k%len(palette)]
		b.LineStyle.Width = 0
		p.Add(b)
		if len(series) > 1 {
			p.Legend.Add(s.name, b)
		}
		xys := make(plotter.XYs, len(s.values))
		labels := make([]string, len(s.values))
		for i, v := range s.values {
			xys[i] = plotter.XY{X: float64(i), Y: v}
			labels[i] = fmt.Sprintf(format, v)
		}
		if lb, err := plotter.NewLabels(plotter.XYLabels{XYs: xys, Labels: labels}); err == nil {
			for i := range lb.TextStyle {
				lb.TextStyle[i].XAlign = draw.XCenter
			}
			lb.Offset = vg.Point{X: vg.Length(offset), Y: vg.Points(3)}
			p.Add(lb)
		}
	}
	p.NominalX(categories...)
	p.Y.Min = 0
	p.Y.Max *= 1.25
	p.Y.Tick.Marker = wholeTicks{}
	p.Legend.Top = true
	return p
}

func throughputPlot(r *report) *plot.Plot {
	const title = "Throughput, 10% of messages failing twice (100 ms, x2)"
	if r.ceil != nil {
		var series []barSeries
		for _, row := range r.ceil.rows {
			series = append(series, barSeries{fmt.Sprintf("%s handler work", row.work), []float64{mean(row.ours), mean(row.ceiling), mean(row.plain)}})
		}
		return bars(fmt.Sprintf("Healthy msg/s, 10%% failing twice, 1 handler (means of %d rounds)", len(r.ceil.rows[0].ours)), "msg/s of never-failing messages",
			[]string{"router + our middleware", "router + ceiling middleware", "plain amqp091-go consumer"},
			series, "%.0f")
	}
	if r.tp == nil || len(r.tp.sets) == 0 {
		return notMeasured(title)
	}
	var series []barSeries
	for _, t := range r.tp.sets {
		name := fmt.Sprintf("%d handlers on the queue", t.handlers)
		if t.handlers == 1 {
			name = "1 handler (the JSON figures)"
		}
		series = append(series, barSeries{name, []float64{t.noFailRate, t.oursHandledRate, t.healthyRate, t.inprocHandledRate}})
	}
	t := r.tp.sets[0]
	inproc := "in-process retry:\nall messages"
	if t.inprocN != t.n {
		inproc = fmt.Sprintf("in-process retry:\nall messages (%d msgs)", t.inprocN)
	}
	return bars(fmt.Sprintf("%s, %d msgs, prefetch 1", title, t.n), "msg/s",
		[]string{"no failures", "broker retry:\nall messages", "broker retry:\nnever-failing only", inproc},
		series, "%.0f")
}

func retryPathPlot(r *report) *plot.Plot {
	const title = "Retry path: every message fails"
	if r.rp == nil || r.rp.oursRate == 0 {
		return notMeasured(title)
	}
	return bars(fmt.Sprintf("%s (%d consumers, one confirm channel)", title, r.rp.concurrency), "per second",
		[]string{"raw amqp091-go into a\nclassic queue", "raw amqp091-go into a\ntier-like queue (reference)", "router + ceiling\nmiddleware", "broker retry:\nretries scheduled"},
		[]barSeries{{"", []float64{r.rp.classicRate, r.rp.rawRate, r.rp.ceilingRate, r.rp.oursRate}}}, "%.0f")
}

// wholeTicks are the default ticks labelled without decimals.
type wholeTicks struct{}

func (wholeTicks) Ticks(min, max float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label = fmt.Sprintf("%.0f", ticks[i].Value)
		}
	}
	return ticks
}

// plotOutages draws the -outage runs into one PNG: per outage length one row of three
// panels over time, with and without outage detection: handled per second, poisoned
// (cumulative), and what waits (in this process, ready in the work queue, parked in
// the delay queues). The dependency's down time is shaded between two grey lines.
func plotOutages(path string, res *outageResults) error {
	var panels [][]*plot.Plot
	for _, k := range res.Order {
		with, without := res.Runs[k]["with"], res.Runs[k]["without"]
		if with == nil && without == nil {
			continue
		}
		panels = append(panels, []*plot.Plot{
			outagePanel(fmt.Sprintf("%s outage: handled per second", k), "messages/s", false, with, without,
				func(s outageSeries) []float64 { return s.handled }, nil, float64(res.Rate)),
			outagePanel(fmt.Sprintf("%s outage: poisoned (cumulative)", k), "messages", false, with, without,
				func(s outageSeries) []float64 { return s.poisoned }, nil, 0),
			outagePanel(fmt.Sprintf("%s outage: waiting (log scale)", k), "messages", true, with, without,
				func(s outageSeries) []float64 { return s.inProc }, []outageExtra{
					{"ready in the work queue", func(s outageSeries) []float64 { return s.ready }},
					{"parked in the delay queues", func(s outageSeries) []float64 { return s.parked }},
				}, 0),
		})
	}
	if len(panels) == 0 {
		return errors.New("no outage run to plot")
	}
	for _, row := range panels {
		for _, p := range row {
			p.Title.TextStyle.Font.Size = vg.Points(13)
			p.X.Label.TextStyle.Font.Size = vg.Points(11)
			p.Y.Label.TextStyle.Font.Size = vg.Points(11)
			p.X.Tick.Label.Font.Size = vg.Points(10)
			p.Y.Tick.Label.Font.Size = vg.Points(10)
			p.Legend.TextStyle.Font.Size = vg.Points(10)
		}
	}
	w, h := 19*vg.Inch, vg.Length(len(panels))*5*vg.Inch+26
	img := vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(96))
	dc := draw.New(img)
	title := fmt.Sprintf("The handler's dependency down: with outage detection (blue) and without (orange). RabbitMQ %s, %s, %d msg/s, MaxAttempts 3, 1 in 25 Permanent, 1 in 5 failing once; %d CPUs",
		res.Broker, res.Backend, res.Rate, numCPU())
	dc.FillText(draw.TextStyle{Color: color.Black, Font: font.From(plot.DefaultFont, 14), Handler: plot.DefaultTextHandler, XAlign: draw.XCenter},
		vg.Point{X: w / 2, Y: h - 18}, title)
	body := draw.Crop(dc, 0, 0, 0, -26)
	tiles := draw.Tiles{Rows: len(panels), Cols: 3, PadX: vg.Inch / 2, PadY: vg.Inch / 2, PadTop: vg.Inch / 8, PadBottom: vg.Inch / 8, PadLeft: vg.Inch / 8, PadRight: vg.Inch / 4}
	canvases := plot.Align(panels, tiles, body)
	for i := range panels {
		for j := range panels[i] {
			panels[i][j].Draw(canvases[i][j])
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

type outageExtra struct {
	name string
	get  func(outageSeries) []float64
}

// outagePanel plots get (and extras, dashed) of both runs against seconds from the
// start; rate, if not 0, is a dashed reference line; logScale floors values at 0.5.
func outagePanel(title, ylabel string, logScale bool, with, without *outageRun, get func(outageSeries) []float64, extras []outageExtra, rate float64) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "seconds from the start"
	p.Y.Label.Text = ylabel
	p.X.Tick.Marker = wholeTicks{}
	if logScale {
		logY(p)
	} else {
		p.Y.Tick.Marker = wholeTicks{}
	}
	const floor = 0.5
	line := func(ys []float64, c color.Color, dashes []vg.Length, label string) {
		if len(ys) == 0 {
			return
		}
		xys := make(plotter.XYs, len(ys))
		for i, y := range ys {
			if logScale {
				y = math.Max(y, floor)
			}
			xys[i] = plotter.XY{X: float64(i) + 0.5, Y: y}
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return
		}
		l.Color, l.Width, l.Dashes = c, vg.Points(1.5), dashes
		p.Add(l)
		p.Legend.Add(label, l)
	}
	var down [2]float64
	for k, r := range []*outageRun{with, without} {
		if r == nil {
			continue
		}
		down = r.down
		name := map[int]string{0: "with detection", 1: "without"}[k]
		if extras == nil {
			line(get(r.series), palette[k], nil, name)
			continue
		}
		line(get(r.series), palette[k], nil, name+": in this process")
		for j, x := range extras {
			line(x.get(r.series), palette[k], []vg.Length{vg.Points(6 - 3*float64(j)), vg.Points(3)}, name+": "+x.name)
		}
	}
	if rate > 0 {
		goalLine(p, rate, fmt.Sprintf("publish rate %.0f/s", rate), color.Gray{Y: 0x60})
	}
	// The dependency's down time: two vertical grey lines.
	lo, hi := p.Y.Min, p.Y.Max
	if logScale {
		lo = math.Max(lo, floor)
	}
	for _, x := range down {
		v, err := plotter.NewLine(plotter.XYs{{X: x, Y: lo}, {X: x, Y: hi}})
		if err == nil {
			v.Color, v.Width = color.Gray{Y: 0x90}, vg.Points(1)
			p.Add(v)
		}
	}
	p.Legend.Top = true
	p.Legend.Left = logScale
	return p
}
