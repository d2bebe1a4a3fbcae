package idemhttp

import (
	"bufio"
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rawH2Server speaks just enough HTTP/2 to reset the first request's
// stream with PROTOCOL_ERROR once it has read the whole request, and to
// answer every later one with a 200.
type rawH2Server struct {
	ln       net.Listener
	requests atomic.Int32
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
	closed   bool
	client   *http.Transport
	url      string
}

func newRawH2Server(t *testing.T) *rawH2Server {
	cert := httptest.NewUnstartedServer(nil)
	cert.EnableHTTP2 = true
	cert.StartTLS()
	client := cert.Client().Transport.(*http.Transport)
	cfg := cert.TLS.Clone()
	cert.Close()
	cfg.NextProtos = []string{"h2"}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	s := &rawH2Server{ln: ln, client: client, url: "https://" + ln.Addr().String()}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			if s.closed {
				c.Close()
			}
			s.conns = append(s.conns, c)
			s.mu.Unlock()
			s.wg.Add(1)
			go func() { defer s.wg.Done(); s.serve(c) }()
		}
	}()
	t.Cleanup(func() {
		client.CloseIdleConnections()
		ln.Close()
		s.mu.Lock()
		s.closed = true
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func writeFrame(w io.Writer, typ, flags byte, stream uint32, payload []byte) error {
	var h [9]byte
	h[0], h[1], h[2] = byte(len(payload)>>16), byte(len(payload)>>8), byte(len(payload))
	h[3], h[4] = typ, flags
	binary.BigEndian.PutUint32(h[5:], stream)
	_, err := w.Write(append(h[:], payload...))
	return err
}

func (s *rawH2Server) serve(c net.Conn) {
	defer c.Close()
	r := bufio.NewReader(c)
	preface := make([]byte, 24)
	if _, err := io.ReadFull(r, preface); err != nil {
		return
	}
	if writeFrame(c, 0x4, 0, 0, nil) != nil { // SETTINGS
		return
	}
	for {
		var h [9]byte
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return
		}
		n := int(h[0])<<16 | int(h[1])<<8 | int(h[2])
		typ, flags, stream := h[3], h[4], binary.BigEndian.Uint32(h[5:])&0x7fffffff
		payload := make([]byte, n)
		if _, err := io.ReadFull(r, payload); err != nil {
			return
		}
		switch {
		case typ == 0x4 && flags&0x1 == 0: // SETTINGS: acknowledge
			writeFrame(c, 0x4, 0x1, 0, nil)
		case typ == 0x6 && flags&0x1 == 0: // PING
			writeFrame(c, 0x6, 0x1, 0, payload)
		case typ == 0x1: // HEADERS: a request
			s.requests.Add(1)
			if flags&0x1 != 0 {
				s.answer(c, stream)
			}
		case typ == 0x0 && flags&0x1 != 0: // DATA ending the request
			s.answer(c, stream)
		}
	}
}

// answer resets the first request's stream, after the server could have
// acted on it, and answers the others with a 200.
func (s *rawH2Server) answer(c net.Conn, stream uint32) {
	if s.requests.Load() == 1 {
		writeFrame(c, 0x3, 0, stream, []byte{0, 0, 0, 1}) // RST_STREAM PROTOCOL_ERROR
		return
	}
	writeFrame(c, 0x1, 0x5, stream, []byte{0x88}) // HEADERS :status 200, END_STREAM
}

// net/http's HTTP/2 sends a request again by itself after a stream reset
// with PROTOCOL_ERROR, which does not prove the server did nothing (this
// server read the whole request first), whenever it can rewind the body
// with GetBody. A POST with no key whose body had no GetBody is one that
// net/http alone would not send again; the copy of it the Transport
// buffers must not let net/http resend it. With a key, the resend is safe
// and still happens, the key the same.
func TestHTTP2ResetDoesNotResendAnUnkeyedBufferedBody(t *testing.T) {
	t.Run("unkeyed POST is sent once", func(t *testing.T) {
		s := newRawH2Server(t)
		c := &http.Client{Transport: NewTransport(s.client, WithKeyedMethods(), WithBackoff(noWait))}
		body := newTrackedBody("charge")
		req, err := http.NewRequest(http.MethodPost, s.url, io.NopCloser(body))
		require.NoError(t, err)
		require.Nil(t, req.GetBody)

		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
		}

		require.Error(t, err, "the reset is the outcome")
		assert.Contains(t, err.Error(), "PROTOCOL_ERROR")
		assert.Equal(t, int32(1), s.requests.Load(), "an unkeyed POST that may have run is not sent again")
	})
	t.Run("keyed POST is sent again", func(t *testing.T) {
		s := newRawH2Server(t)
		c := &http.Client{Transport: NewTransport(s.client, WithBackoff(noWait))}
		req, err := http.NewRequest(http.MethodPost, s.url, io.NopCloser(newTrackedBody("charge")))
		require.NoError(t, err)

		resp, err := c.Do(req)
		require.NoError(t, err)
		resp.Body.Close()

		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, int32(2), s.requests.Load())
	})
}

// A stream reset over HTTP/2 after the handler read the request
// (INTERNAL_ERROR, as net/http's server sends when a handler aborts) may
// follow the handler's effect: a POST without a key is not sent again, one
// with a key is, under the same key, and the caller's request is left as
// it was.
func TestHTTP2StreamResetRetriedOnlyWithAKey(t *testing.T) {
	for _, keyed := range []bool{false, true} {
		t.Run(map[bool]string{false: "unkeyed", true: "keyed"}[keyed], func(t *testing.T) {
			var keys recorder[string]
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				if keys.add(r.Header.Get("Idempotency-Key")) == 1 {
					panic(http.ErrAbortHandler)
				}
				w.WriteHeader(http.StatusCreated)
			}))
			srv.EnableHTTP2 = true
			srv.StartTLS()
			t.Cleanup(srv.Close)
			base := srv.Client().Transport.(*http.Transport)
			t.Cleanup(base.CloseIdleConnections)
			opts := []Option{WithBackoff(noWait)}
			if !keyed {
				opts = append(opts, WithKeyedMethods())
			}
			c := &http.Client{Transport: NewTransport(base, opts...)}
			body := newTrackedBody("charge")
			req, err := http.NewRequest(http.MethodPost, srv.URL, body)
			require.NoError(t, err)
			header := req.Header.Clone()

			resp, err := c.Do(req)

			sent := keys.all()
			if !keyed {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "INTERNAL_ERROR")
				assert.Equal(t, []string{""}, sent, "sent once")
			} else {
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, http.StatusCreated, resp.StatusCode)
				require.Len(t, sent, 2)
				assert.NotEmpty(t, sent[0])
				assert.Equal(t, sent[0], sent[1], "one key for both attempts")
			}
			assert.Equal(t, header, req.Header, "the caller's header is untouched")
			assert.Equal(t, int32(1), body.closes.Load(), "the caller's body closed once")
		})
	}
}
