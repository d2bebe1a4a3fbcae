// Package hostmap holds per-host state that must not grow without bound.
//
// A Map creates a host's value on first use and forgets it again once the
// host has been idle for longer than the idle timeout, or when the map holds
// more hosts than its capacity, least recently used first. Eviction happens
// inline, while a value is looked up, so a Map needs no goroutine of its own
// and costs nothing once its owner is gone.
package hostmap

import (
	"container/list"
	"sync"
	"time"
)

// Map is a bounded, concurrency-safe map from host to a value of type V.
// The zero value is not usable; create one with New.
type Map[V any] struct {
	capacity int
	idle     time.Duration
	create   func(host string) V

	mu    sync.Mutex
	byKey map[string]*list.Element
	lru   list.List // of *entry[V], most recently used at the front
}

type entry[V any] struct {
	host     string
	value    V
	lastUsed time.Time
}

// New returns an empty Map holding at most capacity hosts (at least one)
// and forgetting a host once it has been idle for longer than idle; an idle
// timeout of zero or less never forgets a host for idleness alone. create
// makes the value of a host seen for the first time, or again after it was
// forgotten; it is called with the Map's lock held and must not use the Map.
func New[V any](capacity int, idle time.Duration, create func(host string) V) *Map[V] {
	if capacity < 1 {
		capacity = 1
	}
	return &Map[V]{
		capacity: capacity,
		idle:     idle,
		create:   create,
		byKey:    make(map[string]*list.Element),
	}
}

// Get returns the value of host, creating it if needed, and marks host as
// used at now. Hosts idle since before now minus the idle timeout, and the
// least recently used hosts beyond capacity, are forgotten first.
func (m *Map[V]) Get(host string, now time.Time) V {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.evict(now)
	el := m.lru.Front()
	if el == nil || el.Value.(*entry[V]).host != host {
		// Most calls repeat the last host, which is at the front; only
		// the others pay for hashing it.
		el = m.byKey[host]
	}
	if el != nil {
		e := el.Value.(*entry[V])
		if now.After(e.lastUsed) {
			e.lastUsed = now
		}
		m.lru.MoveToFront(el)
		return e.value
	}
	e := &entry[V]{host: host, value: m.create(host), lastUsed: now}
	m.byKey[host] = m.lru.PushFront(e)
	for m.lru.Len() > m.capacity {
		m.remove(m.lru.Back())
	}
	return e.value
}

// Peek returns the value of host without creating it or marking it used.
func (m *Map[V]) Peek(host string) (v V, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.byKey[host]; ok {
		return el.Value.(*entry[V]).value, true
	}
	return v, false
}

// Len returns the number of hosts held, after forgetting those idle at now.
func (m *Map[V]) Len(now time.Time) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.evict(now)
	return m.lru.Len()
}

// evict forgets the hosts idle at now. The list is ordered by use, so it
// stops at the first host still in use.
func (m *Map[V]) evict(now time.Time) {
	if m.idle <= 0 {
		return
	}
	for el := m.lru.Back(); el != nil; el = m.lru.Back() {
		// Sub of two monotonic readings is a subtraction; now.Add(-idle)
		// would rebuild a Time on every call.
		if now.Sub(el.Value.(*entry[V]).lastUsed) <= m.idle {
			return
		}
		m.remove(el)
	}
}

func (m *Map[V]) remove(el *list.Element) {
	delete(m.byKey, el.Value.(*entry[V]).host)
	m.lru.Remove(el)
}
