package echo

import (
	"strings"
	"testing"
	"time"
)

func TestLoadKnobs(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		check   func(knobs) bool
		wantErr string
	}{
		{name: "defaults", check: func(k knobs) bool {
			return k == knobs{RegisterVersion: 1, PingInterval: 15 * time.Second, PeerTimeout: 45 * time.Second}
		}},
		{name: "everything", env: map[string]string{
			EnvExitBeforeReady: "1", EnvCrash: CrashAfterAnswer, EnvSlowTurn: "150ms", EnvIgnoreShutdown: "true", EnvIgnoreShutdownFrame: "1", EnvExitOnShutdown: "1",
			EnvNoSecret: "1", EnvWrongSecret: "1", EnvFrameVersion: "7", EnvBootDelay: "2s", EnvStopDelay: "300ms",
			EnvNoSessionReport: "1", EnvPingInterval: "10ms", EnvPeerTimeout: "30ms",
			EnvReportSessionFrom: "/f", EnvReportFlood: "20x3800000", EnvAllowRun: "1",
			EnvWorkState: "tool_running", EnvOmitLeaseID: "1", EnvStockStatus: "1",
		}, check: func(k knobs) bool {
			return k == knobs{ExitBeforeReady: true, Crash: CrashAfterAnswer, SlowTurn: 150 * time.Millisecond,
				IgnoreShutdown: true, IgnoreShutdownFrame: true, ExitOnShutdown: true, NoSecret: true, WrongSecret: true, RegisterVersion: 7, BootDelay: 2 * time.Second, StopDelay: 300 * time.Millisecond,
				NoSessionReport: true, PingInterval: 10 * time.Millisecond, PeerTimeout: 30 * time.Millisecond,
				ReportSession: "/f", FloodReports: 20, FloodBytes: 3800000, AllowRun: true, WorkState: "tool_running", OmitLeaseID: true, StockStatus: true}
		}},
		{name: "zero turns a knob off", env: map[string]string{EnvIgnoreShutdown: "0"}, check: func(k knobs) bool { return !k.IgnoreShutdown }},
		{name: "bad bool", env: map[string]string{EnvNoSecret: "yes"}, wantErr: EnvNoSecret},
		{name: "bad crash", env: map[string]string{EnvCrash: "always"}, wantErr: EnvCrash},
		{name: "bad duration", env: map[string]string{EnvSlowTurn: "5"}, wantErr: EnvSlowTurn},
		{name: "negative duration", env: map[string]string{EnvBootDelay: "-1s"}, wantErr: EnvBootDelay},
		{name: "zero ping interval", env: map[string]string{EnvPingInterval: "0s"}, wantErr: EnvPingInterval},
		{name: "bad flood", env: map[string]string{EnvReportFlood: "20"}, wantErr: EnvReportFlood},
		{name: "bad version", env: map[string]string{EnvFrameVersion: "two"}, wantErr: EnvFrameVersion},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, err := loadKnobs(func(name string) string { return tt.env[name] })
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want one naming %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tt.check(k) {
				t.Errorf("got %+v", k)
			}
		})
	}
}
