package idemhttp

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rawServer is a TCP server on 127.0.0.1 that reads one request per
// connection and answers the first cuts requests with a prefix of full
// before closing the connection, and later ones with full.
type rawServer struct {
	l    net.Listener
	wg   sync.WaitGroup
	keys recorder[string] // the key header of each request, in order
}

func newRawServer(t *testing.T, full string, prefix, cuts int) *rawServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &rawServer{l: l}
	s.wg.Go(func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			s.wg.Go(func() {
				defer conn.Close()
				r := bufio.NewReader(conn)
				for {
					req, err := http.ReadRequest(r)
					if err != nil {
						return
					}
					_, _ = io.Copy(io.Discard, req.Body)
					if s.keys.add(req.Header.Get("Idempotency-Key")) <= cuts {
						io.WriteString(conn, full[:prefix])
						return
					}
					io.WriteString(conn, full)
				}
			})
		}
	})
	t.Cleanup(func() {
		l.Close()
		s.wg.Wait()
	})
	return s
}

func (s *rawServer) url() string { return "http://" + s.l.Addr().String() }

func (s *rawServer) received() []string { return s.keys.all() }

// A response lost in the middle of its header block, wherever the cut
// falls, is a lost response: a request that may be sent again is retried,
// and one that may not is not.
func TestResponseCutInItsHeaderBlock(t *testing.T) {
	const full = "HTTP/1.1 201 Created\r\n" +
		"Content-Type: text/plain\r\n" +
		"Content-Length: 7\r\n" +
		"\r\n" +
		"created"
	cuts := []struct {
		name string
		at   string // the response up to the cut
	}{
		{"nothing sent", ""},
		{"mid protocol", "HTTP/"},
		{"before the status code", "HTTP/1.1 "},
		{"mid status code", "HTTP/1.1 20"},
		{"mid reason phrase", "HTTP/1.1 201 Cre"},
		{"after the status line", "HTTP/1.1 201 Created\r\n"},
		{"mid field name", "HTTP/1.1 201 Created\r\nConte"},
		{"before the colon", "HTTP/1.1 201 Created\r\nContent-Type"},
		{"mid value", "HTTP/1.1 201 Created\r\nContent-Type: te"},
		{"between CR and LF", "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r"},
		{"mid second field", "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Len"},
		{"before the blank line", "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 7\r\n"},
		{"mid blank line", "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 7\r\n\r"},
	}
	requests := []struct {
		name   string
		method string
		keyed  bool
		resent bool
	}{
		{"keyed POST", http.MethodPost, true, true},
		{"PUT", http.MethodPut, false, true},
		{"unkeyed POST", http.MethodPost, false, false},
	}
	for _, cut := range cuts {
		require.True(t, strings.HasPrefix(full, cut.at))
		for _, rq := range requests {
			t.Run(cut.name+"/"+rq.name, func(t *testing.T) {
				srv := newRawServer(t, full, len(cut.at), 1)
				opts := []Option{WithBackoff(noWait), WithKeyedMethods()}
				if rq.keyed {
					opts = []Option{WithBackoff(noWait)}
				}
				tr := NewTransport(newBaseTransport(t), opts...)
				req, err := http.NewRequestWithContext(context.Background(), rq.method, srv.url(), strings.NewReader("order"))
				require.NoError(t, err)

				resp, err := tr.RoundTrip(req)

				keys := srv.received()
				if !rq.resent {
					require.Error(t, err)
					var re *RetryError
					require.ErrorAs(t, err, &re)
					assert.Equal(t, ReasonNotRetryable, re.Reason)
					assert.Len(t, keys, 1, "sent once")
					return
				}
				require.NoError(t, err)
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, http.StatusCreated, resp.StatusCode)
				assert.Equal(t, "created", string(body))
				require.Len(t, keys, 2, "retried once")
				assert.Equal(t, keys[0], keys[1], "with the same key")
				assert.Equal(t, rq.keyed, keys[0] != "")
			})
		}
	}
}

// h2cServer is an HTTP/2 server without TLS (prior knowledge), written
// frame by frame, so that it can do what net/http's server never does. On
// the first goaways connections it answers the client's first stream with
// a GOAWAY whose last stream id is 0 and whose error code is
// INTERNAL_ERROR: the server says it did not process the request. On later
// connections it answers 200.
type h2cServer struct {
	l       net.Listener
	wg      sync.WaitGroup
	streams recorder[string] // the method of each request, in order
}

func newH2CServer(t *testing.T, goaways int) *h2cServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &h2cServer{l: l}
	var mu sync.Mutex
	var conns []net.Conn
	s.wg.Go(func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
			s.wg.Go(func() { s.serve(conn, goaways) })
		}
	})
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *h2cServer) serve(conn net.Conn, goaways int) {
	defer conn.Close()
	r := bufio.NewReader(conn)
	if _, err := io.ReadFull(r, make([]byte, len("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))); err != nil {
		return
	}
	frame := func(typ, flags byte, stream uint32, payload ...byte) []byte {
		n := len(payload)
		return append([]byte{byte(n >> 16), byte(n >> 8), byte(n), typ, flags,
			byte(stream >> 24), byte(stream >> 16), byte(stream >> 8), byte(stream)}, payload...)
	}
	for {
		var h [9]byte
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return
		}
		n := int(h[0])<<16 | int(h[1])<<8 | int(h[2])
		if _, err := io.CopyN(io.Discard, r, int64(n)); err != nil {
			return
		}
		const settings, headers, goAway = 0x4, 0x1, 0x7
		if h[3] != headers {
			continue
		}
		// A new stream: the request's header block, which this server
		// does not decode; the method is told by whether a body follows.
		method := http.MethodPost
		if h[4]&0x1 != 0 { // END_STREAM: no body
			method = http.MethodGet
		}
		stream := uint32(h[5]&0x7f)<<24 | uint32(h[6])<<16 | uint32(h[7])<<8 | uint32(h[8])
		var out []byte
		out = append(out, frame(settings, 0, 0)...)
		if s.streams.add(method) <= goaways {
			// Last stream id 0, error code 2 (INTERNAL_ERROR).
			out = append(out, frame(goAway, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2)...)
		} else {
			// HPACK 0x88 is ":status: 200"; END_STREAM|END_HEADERS.
			out = append(out, frame(headers, 0x5, stream, 0x88)...)
		}
		if _, err := conn.Write(out); err != nil {
			return
		}
	}
}

// A GOAWAY that names the request's stream as not processed reaches
// RoundTrip as net/http's "received GOAWAY" error when the stream is the
// connection's first and the GOAWAY carries an error code. It is an HTTP/2
// GOAWAY like any other: requests that may be sent again are retried, and
// an unkeyed POST is not.
func TestHTTP2GoAwayIsRetried(t *testing.T) {
	tests := []struct {
		name     string
		method   string
		keyed    bool
		attempts int
	}{
		{"GET", http.MethodGet, false, 2},
		{"keyed POST", http.MethodPost, true, 2},
		{"unkeyed POST", http.MethodPost, false, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newH2CServer(t, 1)
			base := newBaseTransport(t)
			base.Protocols = new(http.Protocols)
			base.Protocols.SetUnencryptedHTTP2(true)
			var opts []Option
			if !tt.keyed {
				opts = append(opts, WithKeyedMethods())
			}
			tr := NewTransport(base, append(opts, WithBackoff(noWait))...)
			var body io.Reader
			if tt.method == http.MethodPost {
				body = strings.NewReader("charge")
			}
			req, err := http.NewRequestWithContext(context.Background(), tt.method, "http://"+srv.l.Addr().String(), body)
			require.NoError(t, err)

			resp, err := tr.RoundTrip(req)

			assert.Len(t, srv.streams.all(), tt.attempts)
			if tt.attempts == 1 {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "GOAWAY")
				assert.Contains(t, err.Error(), "not retryable")
				return
			}
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, http.StatusOK, resp.StatusCode)
			assert.Equal(t, 2, resp.ProtoMajor)
		})
	}
}
