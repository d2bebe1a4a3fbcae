// Package blockratio summarises paired benchmarks: benchmarks whose sides
// take turns in blocks of requests, so that the machine's load and its
// drift weigh on every side alike, and that compare the sides block by
// block. A side's time per request in each block is divided by another
// side's in the same round ([Ratios]); the median of those ratios
// ([Median]) is the comparison, steadier than the ratio of means.
package blockratio

import "slices"

// Ratios returns a[i]/b[i] for each block i. a and b have the same length.
func Ratios(a, b []float64) []float64 {
	r := make([]float64, len(a))
	for i := range a {
		r[i] = a[i] / b[i]
	}
	return r
}

// Median returns the median of v, which it does not change. v is not
// empty.
func Median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// Mean returns the mean of v, which is not empty.
func Mean(v []float64) float64 {
	var sum float64
	for _, x := range v {
		sum += x
	}
	return sum / float64(len(v))
}
