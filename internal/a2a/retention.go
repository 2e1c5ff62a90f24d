package a2a

import (
	"container/list"
	"time"
)

// scope is a conversation: the unit max_per_context counts in.
type scope struct{ principal, profile, context string }

// entry is one stored task with its places in the two retention orders.
type entry struct {
	rec    *Record
	size   int64         // text bytes, counted against MaxBytes
	all    *list.Element // in Store.order
	conv   *list.Element // in its conversation's list, convOf
	convOf *list.List
}

func (e *entry) scope() scope {
	return scope{e.rec.Principal, e.rec.Profile, e.rec.Task.ContextID}
}

// putLocked makes r its task's record, at the back of both orders.
func (s *Store) putLocked(r *Record) *entry {
	if old := s.tasks[r.Task.ID]; old != nil {
		if old.scope() == (scope{r.Principal, r.Profile, r.Task.ContextID}) {
			old.rec = r
			s.touchLocked(old)
			return old
		}
		s.dropLocked(old)
	}
	e := &entry{rec: r, size: r.bytes()}
	l := s.convs[e.scope()]
	if l == nil {
		l = list.New()
		s.convs[e.scope()] = l
	}
	e.all, e.conv, e.convOf = s.order.PushBack(e), l.PushBack(e), l
	s.tasks[r.Task.ID] = e
	s.bytes += e.size
	return e
}

// touchLocked recounts e's bytes after its record changed and moves it to
// the back of both orders.
func (s *Store) touchLocked(e *entry) {
	s.bytes -= e.size
	e.size = e.rec.bytes()
	s.bytes += e.size
	s.order.MoveToBack(e.all)
	e.convOf.MoveToBack(e.conv)
}

func (s *Store) dropLocked(e *entry) {
	s.order.Remove(e.all)
	l := e.convOf
	l.Remove(e.conv)
	if l.Len() == 0 {
		delete(s.convs, e.scope())
	}
	delete(s.tasks, e.rec.Task.ID)
	s.bytes -= e.size
}

// records is every entry, oldest change first.
func (s *Store) records() []*entry {
	rs := make([]*entry, 0, s.order.Len())
	for el := s.order.Front(); el != nil; el = el.Next() {
		rs = append(rs, el.Value.(*entry))
	}
	return rs
}

// trimConvLocked applies max_per_context to one conversation: its oldest
// finished tasks go first. Only the conversation a change touched can have
// grown past it.
func (s *Store) trimConvLocked(l *list.List) {
	for el := l.Front(); el != nil && l.Len() > s.policy.MaxPerContext; {
		next := el.Next()
		if e := el.Value.(*entry); Terminal(e.rec.Task.Status.State) {
			s.dropLocked(e)
		}
		el = next
	}
}

// expireLocked applies the TTL, the global ceiling and the byte bound,
// oldest change first. A task still in flight is never evicted.
func (s *Store) expireLocked(now time.Time) {
	for el := s.order.Front(); el != nil; {
		e := el.Value.(*entry)
		if now.Sub(e.rec.Updated) <= s.policy.TTL && len(s.tasks) <= MaxTasks && s.bytes <= s.policy.MaxBytes {
			return
		}
		next := el.Next()
		if Terminal(e.rec.Task.Status.State) {
			s.dropLocked(e)
		}
		el = next
	}
}
