package blockratio

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestRatios(t *testing.T) {
	assert.Equal(t, []float64{2, 0.5, 1}, Ratios([]float64{4, 1, 3}, []float64{2, 2, 3}))
}

func TestMedian(t *testing.T) {
	for _, tt := range []struct {
		v    []float64
		want float64
	}{
		{[]float64{5}, 5},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		v := append([]float64(nil), tt.v...)
		assert.Equal(t, tt.want, Median(v))
		assert.Equal(t, tt.v, v, "the input is left as it was")
	}
}

func TestMean(t *testing.T) {
	assert.Equal(t, 2.5, Mean([]float64{1, 2, 3, 4}))
}
