package a2a

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
)

// Manifest is where a long text lives: its fragments in order, its length
// and its digest.
type Manifest struct {
	Len    int      `json:"len"`
	SHA256 string   `json:"sha256"`
	Frags  []string `json:"frags"`
}

func (m *Manifest) check() error {
	if m.Len < 0 || len(m.SHA256) != 64 || len(m.Frags) != (m.Len+FragmentSize-1)/FragmentSize {
		return fmt.Errorf("a text manifest of %d bytes in %d fragments is inconsistent", m.Len, len(m.Frags))
	}
	for _, f := range m.Frags {
		if len(f) != 64 || strings.Trim(f, "0123456789abcdef") != "" {
			return fmt.Errorf("fragment name %q is not a sha256 digest", f)
		}
	}
	return nil
}

// inflate reads every fragmented text of t back into its part, checking
// length and digest.
func (s *Store) inflate(t *Task) error {
	var err error
	each(t, func(p *Part) {
		m := p.Frag
		if m == nil || err != nil {
			return
		}
		var b strings.Builder
		b.Grow(m.Len)
		for _, name := range m.Frags {
			data, rerr := os.ReadFile(filepath.Join(s.frags, name))
			if rerr != nil {
				err = rerr
				return
			}
			b.Write(data)
		}
		text := b.String()
		sum := sha256.Sum256([]byte(text))
		if len(text) != m.Len || hex.EncodeToString(sum[:]) != m.SHA256 {
			err = fmt.Errorf("fragments give %d bytes, the manifest says %d with another digest", len(text), m.Len)
			return
		}
		p.Text, p.Frag = &text, nil
	})
	return err
}

func (s *Store) writeFragments(text string) (*Manifest, error) {
	sum := sha256.Sum256([]byte(text))
	m := &Manifest{Len: len(text), SHA256: hex.EncodeToString(sum[:])}
	for off := 0; off < len(text); off += FragmentSize {
		chunk := []byte(text[off:min(off+FragmentSize, len(text))])
		fs := sha256.Sum256(chunk)
		name := hex.EncodeToString(fs[:])
		path := filepath.Join(s.frags, name)
		if _, err := os.Stat(path); err != nil {
			// Content-addressed and immutable: an existing one is this one.
			f, err := atomicfile.Replace(path, chunk, false, nil)
			if err != nil {
				return nil, err
			}
			_ = f.Close()
		}
		m.Frags = append(m.Frags, name)
	}
	return m, nil
}

func (s *Store) sweepFragmentsLocked(rs []*entry) {
	live := map[string]bool{}
	for _, e := range rs {
		each(&e.rec.Task, func(p *Part) {
			if p.Text == nil || len(*p.Text) <= FragmentSize {
				return
			}
			for off := 0; off < len(*p.Text); off += FragmentSize {
				sum := sha256.Sum256([]byte((*p.Text)[off:min(off+FragmentSize, len(*p.Text))]))
				live[hex.EncodeToString(sum[:])] = true
			}
		})
	}
	entries, err := os.ReadDir(s.frags)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !live[e.Name()] {
			_ = os.Remove(filepath.Join(s.frags, e.Name()))
		}
	}
}
