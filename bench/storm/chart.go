package main

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// series is one line of a chart: a value per bin.
type series struct {
	name   string
	values []float64
}

var palette = []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"}

// renderChart draws requests per second over time as an SVG line chart,
// with the outage from outageStart to outageEnd shaded.
func renderChart(lines []series, bin, outageStart, outageEnd time.Duration) string {
	const (
		width, height                 = 960, 480
		left, right, top, bot         = 70, 20, 40, 130
		plotW, plotH          float64 = width - left - right, height - top - bot
	)
	bins, peak := 0, 0.0
	for _, l := range lines {
		bins = max(bins, len(l.values))
		for _, v := range l.values {
			peak = max(peak, v)
		}
	}
	total := time.Duration(bins) * bin
	yMax, yStep := niceScale(peak)
	x := func(d time.Duration) float64 { return left + plotW*d.Seconds()/total.Seconds() }
	y := func(v float64) float64 { return top + plotH*(1-v/yMax) }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="16" font-weight="bold">Requests per second reaching the server, through a 100%% 503 outage</text>`+"\n", left)

	// The outage.
	fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="%.1f" height="%.1f" fill="#fbe3e3"/>`+"\n",
		x(outageStart), top, x(outageEnd)-x(outageStart), plotH)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#a33">outage: every request gets 503</text>`+"\n",
		(x(outageStart)+x(outageEnd))/2, top+16)

	// Grid and axes.
	for v := 0.0; v <= yMax+yStep/2; v += yStep {
		fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, left+plotW, y(v), y(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", left-8, y(v)+4, v)
	}
	for s := 0; s <= int(total.Seconds()); s += 2 {
		xs := x(time.Duration(s) * time.Second)
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#999"/>`+"\n", xs, xs, top+plotH, top+plotH+5)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%d</text>`+"\n", xs, top+plotH+20, s)
	}
	fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#333"/>`+"\n", left, left+plotW, top+plotH, top+plotH)
	fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%.1f" stroke="#333"/>`+"\n", left, left, top, top+plotH)
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">seconds since start</text>`+"\n", left+plotW/2, top+plotH+40)
	fmt.Fprintf(&b, `<text transform="translate(18 %.1f) rotate(-90)" text-anchor="middle">attempts/s at the server</text>`+"\n", top+plotH/2)

	// Lines, each point at the middle of its bin.
	for i, l := range lines {
		color := palette[i%len(palette)]
		var pts []string
		for j, v := range l.values {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(time.Duration(j)*bin+bin/2), y(v)))
		}
		w := 2.0
		if i == 0 {
			w = 3
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="%g" stroke-linejoin="round" points="%s"/>`+"\n",
			color, w, strings.Join(pts, " "))
		// Legend, two columns under the axis.
		lx := float64(left) + float64(i%2)*plotW/2
		ly := top + plotH + 68 + float64(i/2)*24
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="%s" stroke-width="%g"/>`+"\n", lx, lx+28, ly-4, ly-4, color, w)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", lx+36, ly, escape(l.name))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// niceScale returns an axis maximum at or above peak and a round step that
// divides it into at most ten parts.
func niceScale(peak float64) (top, step float64) {
	if peak <= 0 {
		return 1, 1
	}
	raw := peak / 8
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if step = m * mag; step >= raw {
			break
		}
	}
	return math.Ceil(peak/step) * step, step
}

func escape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;").Replace(s)
}
