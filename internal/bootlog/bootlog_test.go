package bootlog

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

func logged(err error) string {
	var b bytes.Buffer
	Log(slog.New(slog.NewTextHandler(&b, nil)), err, "it failed")
	return b.String()
}

func TestRecord(t *testing.T) {
	inner := Wrap(OpenState, errors.New("locked"), "state_dir", "/s")
	for _, c := range []struct {
		err  error
		want string
	}{
		{Wrap(LoadConfig, errors.New(`bad "x"`), "path", "b.yaml"), `level=ERROR msg="failed to load config" path=b.yaml error="bad \"x\""`},
		// The innermost step's record, with the whole error's text.
		{Wrap(LoadConfig, fmt.Errorf("opening: %w", inner), "path", "b.yaml"), `level=ERROR msg="failed to open lease state" state_dir=/s error="opening: locked"`},
		{errors.New("boom"), `level=ERROR msg="it failed" error=boom`},
	} {
		if got := logged(c.err); !strings.HasSuffix(got, " "+c.want+"\n") || strings.Count(got, "\n") != 1 {
			t.Errorf("Log(%v) = %q, want one record ending %q", c.err, got, c.want)
		}
	}
	// A key's error gets the config record; another error, or one with a
	// record, keeps what it has.
	if got := logged(Config(errors.New("broker config: binaries: x"), "b.yaml")); !strings.Contains(got, `msg="failed to load config" path=b.yaml error="broker config: binaries: x"`) {
		t.Errorf("Config of a key's error logged %q", got)
	}
	if got := logged(Config(errors.New("cgroup: EIO"), "b.yaml")); !strings.Contains(got, `msg="it failed" error="cgroup: EIO"`) {
		t.Errorf("Config of another error logged %q", got)
	}
	if got := logged(Config(Wrap(OpenState, errors.New("broker config: state_dir: x")), "b.yaml")); !strings.Contains(got, `msg="failed to open lease state"`) {
		t.Errorf("Config of an error with a record logged %q", got)
	}
	if Config(nil, "b.yaml") != nil || Wrap(LoadConfig, nil) != nil {
		t.Error("Wrap of nil is not nil")
	}
}
