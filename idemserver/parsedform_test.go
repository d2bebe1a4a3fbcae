package idemserver

import (
	"bytes"
	"io"
	"mime/multipart"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// parseFormInFront is middleware that reads the request's form before the
// idempotency middleware, as CSRF middleware does to find its token: the
// form body is consumed, and the handler reads the form from the request.
func parseFormInFront(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseMultipartForm(1 << 20)
		next.ServeHTTP(w, r)
	})
}

// formHandler charges the amount in the form it is sent.
func formHandler(calls *int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		*calls++
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("charged " + r.PostFormValue("amount")))
	})
}

func urlencoded(body string) func() *http.Request {
	return func() *http.Request {
		r := newRequest(http.MethodPost, "/charges", "k", body)
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		return r
	}
}

func multipartForm(t *testing.T, amount, file string) func() *http.Request {
	return func() *http.Request {
		var b bytes.Buffer
		mw := multipart.NewWriter(&b)
		require.NoError(t, mw.SetBoundary("boundary"))
		require.NoError(t, mw.WriteField("amount", amount))
		if file != "" {
			fw, err := mw.CreateFormFile("receipt", "receipt.txt")
			require.NoError(t, err)
			_, _ = fw.Write([]byte(file))
		}
		require.NoError(t, mw.Close())
		r := newRequest(http.MethodPost, "/charges", "k", b.String())
		r.Header.Set("Content-Type", mw.FormDataContentType())
		return r
	}
}

// TestFormParsedInFront checks that a request whose form a middleware in
// front parsed, consuming its body, is still told apart from a different
// one with the same key: its fingerprint covers the form the handler reads.
func TestFormParsedInFront(t *testing.T) {
	for _, tt := range []struct {
		name          string
		first, second func() *http.Request
		mismatch      bool
	}{
		{"same form replays", urlencoded("amount=10"), urlencoded("amount=10"), false},
		{"other amount", urlencoded("amount=10"), urlencoded("amount=1000"), true},
		{"same multipart form replays", multipartForm(t, "10", "r1"), multipartForm(t, "10", "r1"), false},
		{"other multipart amount", multipartForm(t, "10", ""), multipartForm(t, "1000", ""), true},
		{"other multipart file", multipartForm(t, "10", "r1"), multipartForm(t, "10", "r2"), true},
		{"multipart file added", multipartForm(t, "10", ""), multipartForm(t, "10", "r1"), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			calls := 0
			h := parseFormInFront(Middleware(nil)(formHandler(&calls)))
			first := serve(h, tt.first())
			require.Equal(t, http.StatusCreated, first.Code)
			require.True(t, strings.HasPrefix(first.Body.String(), "charged 10"), first.Body.String())
			w := serve(h, tt.second())
			if tt.mismatch {
				decodeProblem(t, w, ProblemFingerprintMismatch, http.StatusUnprocessableEntity)
			} else {
				assert.Equal(t, "true", w.Header().Get(ReplayedHeader))
				assert.Equal(t, first.Body.String(), w.Body.String())
			}
			assert.Equal(t, 1, calls, "handler runs")
		})
	}
}

// TestFormParsedInFrontLimit checks that the form a middleware in front
// parsed counts against the body limit, files included.
func TestFormParsedInFrontLimit(t *testing.T) {
	calls := 0
	h := parseFormInFront(Middleware(nil, WithMaxBodyBytes(400))(formHandler(&calls)))
	// The announced length is checked before the form: it must be within
	// the limit for the form to count.
	r := multipartForm(t, "10", strings.Repeat("x", 500))()
	r.ContentLength = -1
	w := serve(h, r)
	p := decodeProblem(t, w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge)
	assert.Contains(t, p.Detail, "form")
	w = serve(h, multipartForm(t, "10", "r1")())
	assert.Equal(t, http.StatusCreated, w.Code, w.Body.String())
	assert.Equal(t, 1, calls, "handler runs")
}

// TestFormParsedInFrontBodyLeft checks that a form parsed in front counts
// when the body was not all consumed: a multipart reader stops at the
// closing boundary and leaves what follows it (an epilogue) unread, so the
// middleware reads only that. Two requests whose forms differ but whose
// epilogues are the same must still be told apart.
func TestFormParsedInFrontBodyLeft(t *testing.T) {
	epilogue := "\r\n" + strings.Repeat("e", 64<<10)
	withEpilogue := func(amount string) func() *http.Request {
		return func() *http.Request {
			r := multipartForm(t, amount, "")()
			b, err := io.ReadAll(r.Body)
			require.NoError(t, err)
			r.Body = io.NopCloser(strings.NewReader(string(b) + epilogue))
			r.ContentLength = int64(len(b) + len(epilogue))
			return r
		}
	}
	calls := 0
	h := parseFormInFront(Middleware(nil)(formHandler(&calls)))
	first := serve(h, withEpilogue("10")())
	require.Equal(t, http.StatusCreated, first.Code, first.Body.String())
	require.Equal(t, "charged 10", first.Body.String())
	// An amount as long, so that as much of the epilogue is left.
	w := serve(h, withEpilogue("90")())
	decodeProblem(t, w, ProblemFingerprintMismatch, http.StatusUnprocessableEntity)
	assert.Equal(t, 1, calls, "handler runs")
	w = serve(h, withEpilogue("10")())
	assert.Equal(t, "true", w.Header().Get(ReplayedHeader))
	assert.Equal(t, first.Body.String(), w.Body.String())
}

// TestFormParsedInFrontFilesOnDisk parses forms in front with little
// memory, so that their files are kept in temporary files: the fingerprint
// reads them from there, and tells files of one size apart by content.
func TestFormParsedInFrontFilesOnDisk(t *testing.T) {
	front := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			require.NoError(t, r.ParseMultipartForm(1))
			defer func() { _ = r.MultipartForm.RemoveAll() }()
			for _, fh := range r.MultipartForm.File["receipt"] {
				f, err := fh.Open()
				require.NoError(t, err)
				_, onDisk := f.(*os.File)
				require.NoError(t, f.Close())
				require.True(t, onDisk, "the file is on disk")
			}
			next.ServeHTTP(w, r)
		})
	}
	calls := 0
	h := front(Middleware(nil)(formHandler(&calls)))
	first := serve(h, multipartForm(t, "10", strings.Repeat("a", 64<<10))())
	require.Equal(t, http.StatusCreated, first.Code, first.Body.String())
	w := serve(h, multipartForm(t, "10", strings.Repeat("a", 64<<10))())
	assert.Equal(t, "true", w.Header().Get(ReplayedHeader))
	w = serve(h, multipartForm(t, "10", strings.Repeat("a", 64<<10-1)+"b")())
	decodeProblem(t, w, ProblemFingerprintMismatch, http.StatusUnprocessableEntity)
	assert.Equal(t, 1, calls, "handler runs")
}

// TestFormFileGoneFromDisk checks that a form file that cannot be read
// back from the server's temporary files is answered as the server's
// failure, which invites the request again, and not as a bad request,
// which a client takes as final; the answer names no file of the server.
func TestFormFileGoneFromDisk(t *testing.T) {
	front := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			require.NoError(t, r.ParseMultipartForm(1))
			require.NoError(t, r.MultipartForm.RemoveAll(), "the files leave the disk")
			next.ServeHTTP(w, r)
		})
	}
	calls := 0
	h := front(Middleware(nil)(formHandler(&calls)))
	w := serve(h, multipartForm(t, "10", strings.Repeat("a", 64<<10))())
	p := decodeProblem(t, w, ProblemBodyUnreadable, http.StatusInternalServerError)
	assert.NotContains(t, p.Detail, os.TempDir(), "the detail names no file of the server")
	assert.Zero(t, calls, "handler runs")
}
