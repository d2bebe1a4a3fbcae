// Command idemload measures the throughput of the idemserver middleware
// over loopback, from a process of its own.
//
// It has two parts. "idemload serve" runs a server whose handler reads a
// small JSON body and answers 201 with a small JSON document, either bare
// or behind idemserver.Middleware with a MemoryStore:
//
//	idemload serve -addr 127.0.0.1:8181 -mode bare
//	idemload serve -addr 127.0.0.1:8182 -mode idem
//
// "idemload hit" then sends keep-alive POSTs from concurrent workers for a
// while and prints one line of results:
//
//	idemload hit -url http://127.0.0.1:8182/charges -keys new -c 16 -d 10s
//
// With -keys new every request carries a fresh Idempotency-Key, so each one
// runs the handler; with -keys replay every worker repeats one key, so all
// but its first request are replays; with -keys none no key is sent.
// server-throughput.sh beside this module runs the whole comparison.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

const body = `{"amount":1999,"currency":"EUR","customer":"cus_123","description":"order 1234"}`

func main() {
	log.SetFlags(0)
	if len(os.Args) < 2 {
		log.Fatal("usage: idemload serve|hit [flags]")
	}
	switch os.Args[1] {
	case "serve":
		serve(os.Args[2:])
	case "hit":
		hit(os.Args[2:])
	default:
		log.Fatalf("idemload: unknown command %q", os.Args[1])
	}
}

func serve(args []string) {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:8181", "listen address")
	mode := fs.String("mode", "bare", "bare or idem")
	work := fs.Duration("work", 0, "time the handler spends waiting, as on a database call")
	profile := fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	_ = fs.Parse(args)
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}

	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if *work > 0 {
			time.Sleep(*work)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_1","status":"succeeded","amount":1999}`)
	})
	switch *mode {
	case "bare":
	case "idem":
		// New keys keep coming for the whole run: a store that evicts the
		// oldest of 100,000 records stays in one steady state, where the
		// default one would fill up and refuse new keys.
		// Evictions are the load's design, not news: they are reported to
		// nothing, which a store that evicts must be told.
		store := idemserver.NewMemoryStore(idemserver.WithMaxEntries(100_000), idemserver.WithEvictOldest(),
			idemserver.WithEvictionReport(func(idemserver.Eviction) {}))
		defer store.Close()
		h = idemserver.Middleware(store)(h)
	default:
		log.Fatalf("idemload: unknown mode %q", *mode)
	}
	// /stats reports the requests served and the CPU time the process has
	// used, so that the client can work out the server's CPU per request,
	// which other load on the machine disturbs far less than throughput.
	var served atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		cpu := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		fmt.Fprintf(w, "%d %d\n", served.Load(), cpu.Nanoseconds())
	})
	mux.Handle("/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		h.ServeHTTP(w, r)
	}))
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	go func() {
		<-ctx.Done()
		_ = srv.Shutdown(context.Background())
	}()
	if err := srv.ListenAndServe(); err != http.ErrServerClosed {
		log.Print(err)
	}
}

func hit(args []string) {
	fs := flag.NewFlagSet("hit", flag.ExitOnError)
	url := fs.String("url", "http://127.0.0.1:8181/charges", "target URL")
	keys := fs.String("keys", "new", "new, replay or none")
	conc := fs.Int("c", 16, "concurrent workers, one connection each")
	dur := fs.Duration("d", 10*time.Second, "measured duration")
	warm := fs.Duration("warmup", time.Second, "unmeasured warm-up before it")
	label := fs.String("label", "", "label printed with the results")
	_ = fs.Parse(args)

	client := &http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: *conc,
		MaxConnsPerHost:     *conc,
		DisableCompression:  true,
	}}
	start := time.Now().Add(*warm)
	end := start.Add(*dur)
	run := strconv.FormatInt(time.Now().UnixNano(), 36)

	type result struct {
		lat    []time.Duration
		status map[int]int
		errs   int
	}
	results := make([]result, *conc)
	statsURL := strings.TrimSuffix(*url, "/charges") + "/stats"
	before := make(chan stats, 1)
	go func() {
		time.Sleep(time.Until(start))
		before <- readStats(client, statsURL)
	}()
	var wg sync.WaitGroup
	for w := range *conc {
		wg.Go(func() {
			res := result{status: map[int]int{}}
			prefix := run + "-" + strconv.Itoa(w) + "-"
			for n := 0; ; n++ {
				t0 := time.Now()
				if !t0.Before(end) {
					break
				}
				req, err := http.NewRequest(http.MethodPost, *url, strings.NewReader(body))
				if err != nil {
					log.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/json")
				switch *keys {
				case "new":
					req.Header.Set("Idempotency-Key", prefix+strconv.Itoa(n))
				case "replay":
					req.Header.Set("Idempotency-Key", prefix+"replayed")
				}
				resp, err := client.Do(req)
				if err != nil {
					res.errs++
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if t0.After(start) {
					res.lat = append(res.lat, time.Since(t0))
					res.status[resp.StatusCode]++
				}
			}
			results[w] = res
		})
	}
	wg.Wait()
	after := readStats(client, statsURL)
	b := <-before
	cpuPerReq := time.Duration(0)
	if n := after.requests - b.requests; n > 0 {
		cpuPerReq = (after.cpu - b.cpu) / time.Duration(n)
	}

	var lat []time.Duration
	status := map[int]int{}
	errs := 0
	for _, r := range results {
		lat = append(lat, r.lat...)
		for k, v := range r.status {
			status[k] += v
		}
		errs += r.errs
	}
	slices.Sort(lat)
	pct := func(p float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[int(p*float64(len(lat)-1))]
	}
	perCore := 0.0
	if cpuPerReq > 0 {
		perCore = float64(time.Second) / float64(cpuPerReq)
	}
	fmt.Printf("%-12s keys=%-6s c=%d req/s=%7.0f server-cpu/req=%6.2fµs req/s-per-server-core=%7.0f p50=%v p99=%v statuses=%v errors=%d\n",
		*label, *keys, *conc, float64(len(lat))/dur.Seconds(), float64(cpuPerReq)/1e3, perCore,
		pct(0.50).Round(time.Microsecond), pct(0.99).Round(time.Microsecond), status, errs)
}

type stats struct {
	requests int64
	cpu      time.Duration
}

func readStats(c *http.Client, url string) stats {
	resp, err := c.Get(url)
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	var s stats
	var ns int64
	if _, err := fmt.Fscan(resp.Body, &s.requests, &ns); err != nil {
		log.Fatalf("idemload: reading %s: %v", url, err)
	}
	s.cpu = time.Duration(ns)
	return s
}
