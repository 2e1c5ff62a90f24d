package a2a

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// The conformance corpus: testdata/conformance/*.json, one vector per
// mapping rule, judged against Turn, InputText and Reply. A vector the
// transport cannot produce carries "skip" with the reason and is reported
// as a named skip on every run, never faked.

type vector struct {
	Rule     string                    `json:"rule"`
	Skip     string                    `json:"skip"`
	Payloads []json.RawMessage         `json:"payloads"`
	Message  *Message                  `json:"message"`
	Question *Question                 `json:"question"`
	Replies  map[string]brokerframe.IO `json:"replies"`
	Want     struct {
		Steps  []string `json:"steps"`
		Answer *string  `json:"answer"`
		Input  *string  `json:"input"`
		Error  string   `json:"error"`
	} `json:"want"`
}

var stepNames = map[Step]string{
	StepWorking: "working", StepInputRequired: "input_required", StepCompleted: "completed", StepCanceled: "canceled",
}

func TestConformance(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "conformance", "*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no conformance vectors: %v", err)
	}
	var passed, skipped []string
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".json")
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var v vector
		if err := json.Unmarshal(data, &v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		ok := t.Run(name, func(t *testing.T) {
			if v.Skip != "" {
				skipped = append(skipped, name)
				t.Skipf("%s: %s", v.Rule, v.Skip)
			}
			v.check(t)
		})
		if ok && v.Skip == "" {
			passed = append(passed, name)
		}
	}
	t.Logf("conformance: %d of %d vectors pass, %d skipped by name: %s", len(passed), len(files), len(skipped), strings.Join(skipped, ", "))
}

func (v *vector) check(t *testing.T) {
	switch {
	case v.Payloads != nil:
		var turn Turn
		var steps []string
		for _, p := range v.Payloads {
			if s := turn.Apply(p); s != StepNone {
				steps = append(steps, stepNames[s])
			}
		}
		if !reflect.DeepEqual(steps, v.Want.Steps) {
			t.Errorf("%s: steps %v, want %v", v.Rule, steps, v.Want.Steps)
		}
		if v.Want.Answer != nil && turn.Answer() != *v.Want.Answer {
			t.Errorf("%s: answer %q, want %q", v.Rule, turn.Answer(), *v.Want.Answer)
		}
	case v.Message != nil:
		in, err := InputText(v.Message)
		switch {
		case v.Want.Error != "" && (err == nil || err.Reason != v.Want.Error):
			t.Errorf("%s: error %v, want %s", v.Rule, err, v.Want.Error)
		case v.Want.Input != nil && (err != nil || in != *v.Want.Input):
			t.Errorf("%s: input %q (%v), want %q", v.Rule, in, err, *v.Want.Input)
		}
	case v.Question != nil:
		for text, want := range v.Replies {
			if got := Reply(v.Question, text); !reflect.DeepEqual(got, want) {
				t.Errorf("%s: reply to %q is %+v, want %+v", v.Rule, text, got, want)
			}
		}
	default:
		t.Fatalf("vector has no payloads, message or question")
	}
}
