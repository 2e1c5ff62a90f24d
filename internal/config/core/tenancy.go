package core

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
)

// Tenancy is the tenancy: block (ours): one OS identity per principal,
// read by nexus-spawnd alone. nil means every instance runs with its
// entry's credential, as without the block.
type Tenancy struct {
	// UIDRange is "lo-hi": the uids, and the gids of the same numbers,
	// spawnd gives principals, one each, for ever.
	UIDRange string `yaml:"uid_range"`
	// HomesDir holds one home per allocated uid, <homes_dir>/<uid>.
	HomesDir string `yaml:"homes_dir"`
	// Sandbox is none or strict (bubblewrap); required.
	Sandbox string `yaml:"sandbox"`
}

// The sandboxes tenancy.sandbox names.
const (
	SandboxNone   = "none"
	SandboxStrict = "strict"
)

// Range parses uid_range; Validate has checked it.
func (t *Tenancy) Range() (lo, hi uint32) {
	l, h, _ := parseRange(t.UIDRange)
	return l, h
}

func parseRange(s string) (lo, hi uint32, err error) {
	a, b, ok := strings.Cut(strings.TrimSpace(s), "-")
	l, err1 := strconv.ParseUint(strings.TrimSpace(a), 10, 32)
	h, err2 := strconv.ParseUint(strings.TrimSpace(b), 10, 32)
	switch {
	case !ok || err1 != nil || err2 != nil:
		return 0, 0, fmt.Errorf("%q is not lo-hi, two uids such as \"200000-265535\"", s)
	case l == 0:
		return 0, 0, errors.New("starts at 0, which is root; start the range above every uid of this host")
	case l > h:
		return 0, 0, fmt.Errorf("%q has lo > hi; write the smaller uid first", s)
	case h > maxID:
		return 0, 0, fmt.Errorf("%q ends past %d, the largest usable uid", s, int64(maxID))
	}
	return uint32(l), uint32(h), nil
}

// validateTenancy checks the block's own shape and what it cannot go
// with; what it needs of this machine (its uids, root, bubblewrap) is
// nexus-spawnd's to check.
func (c *Config) validateTenancy() error {
	t := c.Tenancy
	if t == nil {
		return nil
	}
	if _, _, err := parseRange(t.UIDRange); err != nil {
		return fmt.Errorf("broker config: tenancy.uid_range: %w", err)
	}
	if !filepath.IsAbs(t.HomesDir) {
		return fmt.Errorf("broker config: tenancy.homes_dir: %q is not an absolute path; give the directory holding one home per principal, such as /var/lib/nexus-broker/homes", t.HomesDir)
	}
	if err := CheckNoNUL("tenancy.homes_dir", t.HomesDir); err != nil {
		return err
	}
	t.HomesDir = filepath.Clean(t.HomesDir)
	if t.Sandbox != SandboxNone && t.Sandbox != SandboxStrict {
		return fmt.Errorf("broker config: tenancy.sandbox: %q is neither none nor strict; the key is required: strict runs every instance in a bubblewrap sandbox, none only under its principal's uid", t.Sandbox)
	}
	if c.StateDir == "" {
		return errors.New("broker config: tenancy: needs state_dir, where the uid of every principal is recorded so it keeps it across restarts; set state_dir")
	}
	if c.RunAs != nil {
		return errors.New("broker config: tenancy: cannot go with run_as, which would run instances under one credential for every principal; remove run_as")
	}
	for _, name := range sortedKeys(c.Binaries) {
		if c.Binaries[name].RunAs != nil {
			return fmt.Errorf("broker config: tenancy: cannot go with binaries.%s.run_as, which would run that entry's instances under one credential for every principal; remove it", name)
		}
	}
	return nil
}
