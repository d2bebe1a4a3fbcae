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
