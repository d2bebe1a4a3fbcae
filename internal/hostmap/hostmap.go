// Package hostmap holds per-host state that must not grow without bound.
//
// A Map creates a host's value on first use and forgets it again once the
// host has been idle for longer than the idle timeout, or when the map holds
// more hosts than its capacity, least recently used first. Eviction happens
// inline, while a value is looked up, so a Map needs no goroutine of its own
// and costs nothing once its owner is gone.
package hostmap

import (
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
	byKey map[string]*entry[V]
	// The entries in order of use, most recent at the front. The list is
	// threaded through the entries themselves: a lookup of the host at the
	// front, the common case, then touches only the Map and that entry.
	front, back *entry[V]
}

type entry[V any] struct {
	host       string
	value      V
	lastUsed   time.Time
	prev, next *entry[V] // toward the front, toward the back
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
		byKey:    make(map[string]*entry[V]),
	}
}

// Get returns the value of host, creating it if needed, and marks host as
// used at now. Hosts idle since before now minus the idle timeout, and the
// least recently used hosts beyond capacity, are forgotten first.
func (m *Map[V]) Get(host string, now time.Time) V {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.evict(now)
	e := m.front
	if e == nil || e.host != host {
		// Most calls repeat the last host, which is at the front; only
		// the others pay for hashing it.
		e = m.byKey[host]
		if e == nil {
			e = &entry[V]{host: host, value: m.create(host), lastUsed: now}
			m.byKey[host] = e
			m.pushFront(e)
			for len(m.byKey) > m.capacity {
				m.remove(m.back)
			}
			return e.value
		}
		m.unlink(e)
		m.pushFront(e)
	}
	if now.After(e.lastUsed) {
		e.lastUsed = now
	}
	return e.value
}

// Peek returns the value of host without creating it or marking it used.
func (m *Map[V]) Peek(host string) (v V, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.byKey[host]; ok {
		return e.value, true
	}
	return v, false
}

// Len returns the number of hosts held, after forgetting those idle at now.
func (m *Map[V]) Len(now time.Time) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.evict(now)
	return len(m.byKey)
}

// evict forgets the hosts idle at now. The list is ordered by use, so it
// stops at the first host still in use.
func (m *Map[V]) evict(now time.Time) {
	if m.idle <= 0 {
		return
	}
	for e := m.back; e != nil; e = m.back {
		// Sub of two monotonic readings is a subtraction; now.Add(-idle)
		// would rebuild a Time on every call.
		if now.Sub(e.lastUsed) <= m.idle {
			return
		}
		m.remove(e)
	}
}

func (m *Map[V]) remove(e *entry[V]) {
	delete(m.byKey, e.host)
	m.unlink(e)
}

// pushFront puts e, which is in no list, at the front.
func (m *Map[V]) pushFront(e *entry[V]) {
	e.next = m.front
	if m.front != nil {
		m.front.prev = e
	} else {
		m.back = e
	}
	m.front = e
}

// unlink takes e out of the list.
func (m *Map[V]) unlink(e *entry[V]) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		m.front = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		m.back = e.prev
	}
	e.prev, e.next = nil, nil
}
