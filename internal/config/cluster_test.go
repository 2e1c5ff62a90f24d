package config

import (
	"strings"
	"testing"
	"time"
)

const clusterOK = "state_dir: /var/lib/nexus\nadvertise_addr: \"10.0.0.1:8080\"\ncluster:\n  urls: nats://127.0.0.1:4222\n  secret_env: NEXUS_CLUSTER_SECRET\n"

// TestClusterErrors: every incomplete or conflicting cluster setting
// refuses the boot naming the key.
func TestClusterErrors(t *testing.T) {
	secret := strings.Repeat("s", MinClusterSecret)
	for _, tc := range []struct{ name, yaml, key, want string }{
		{"no urls", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  secret_env: S\n", "cluster.urls", "required"},
		{"bad url", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: http://x:1\n  secret_env: S\n", "cluster.urls[0]", "is not nats://"},
		{"no secret", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n", "cluster.secret", "required; write secret (the value) or secret_env"},
		{"both secrets", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret: " + secret + "\n  secret_env: S\n", "cluster.secret", "set together with secret_env"},
		{"short secret", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret: short\n", "cluster.secret", "too short"},
		{"creds and seed", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  creds_file: /c\n  nkey_seed_env: K\n", "cluster.creds_file", "neither wins"},
		{"bad seed env", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  nkey_seed_env: \"A=B\"\n", "cluster.nkey_seed_env", "is not an environment variable name"},
		{"no state_dir", "advertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n", "state_dir", "required with cluster:"},
		{"no advertise_addr", "state_dir: /s\ncluster:\n  urls: nats://x:1\n  secret_env: S\n", "advertise_addr", "required with cluster:"},
		{"bad broker_id", "state_dir: /s\nbroker_id: a.b\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n", "broker_id", "cannot name a broker in cluster mode"},
		{"bad prefix", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  subject_prefix: a.*\n", "cluster.subject_prefix", "is not a NATS subject"},
		{"tiny heartbeat", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  heartbeat_interval: 1ms\n", "cluster.heartbeat_interval", "below 10ms"},
		{"short forget_after", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  forget_after: 2s\n", "cluster.forget_after", "shorter than three heartbeat intervals (3s)"},
		{"negative forget_after", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  forget_after: -1h\n", "cluster.forget_after", "shorter than three heartbeat intervals"},
		{"tiny offer_timeout", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  offer_timeout: 10us\n", "cluster.offer_timeout", "below 1ms"},
		{"unknown key", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  url: nats://x:1\n", "cluster.url", "unknown key; the keys allowed here are creds_file, forget_after, heartbeat_interval, nkey_seed, nkey_seed_env, offer_timeout, password_env, secret, secret_env, subject_prefix, tls_ca, urls, user"},
		{"user without password", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  user: b1\n", "cluster.user", "go together"},
		{"user and creds", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  user: b1\n  password_env: P\n  creds_file: /c\n", "cluster.user", "neither wins"},
		{"user twice", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://u:pw@x:1\n  secret_env: S\n  user: b1\n  password_env: P\n", "cluster.urls[0]", "carries a user"},
		{"bad password env", "state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: nats://x:1\n  secret_env: S\n  user: b1\n  password_env: \"A=B\"\n", "cluster.password_env", "is not an environment variable name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("parsed as %+v; want an error naming %q", c, tc.key)
			}
			if msg := err.Error(); !strings.HasPrefix(msg, "broker config: "+tc.key+": ") || !strings.Contains(msg, tc.want) {
				t.Errorf("error %q\nwant it to start %q and say %q", msg, "broker config: "+tc.key+": ", tc.want)
			}
		})
	}
}

// TestClusterDefaults: no cluster: block is single-broker mode; a minimal
// one gets the default prefix and heartbeat.
func TestClusterDefaults(t *testing.T) {
	c, err := Parse([]byte("max_concurrent: 2\n"))
	if err != nil || c.Cluster != nil {
		t.Fatalf("no cluster: block: got %+v, %v; want nil, nil", c.Cluster, err)
	}
	c, err = Parse([]byte(clusterOK))
	if err != nil {
		t.Fatal(err)
	}
	if k := c.Cluster; k.SubjectPrefix != DefaultSubjectPrefix || k.HeartbeatInterval.D() != time.Second || k.ForgetAfter.D() != 24*time.Hour || k.OfferTimeout.D() != 250*time.Millisecond {
		t.Errorf("defaults: prefix %q heartbeat %s forget_after %s offer_timeout %s", k.SubjectPrefix, k.HeartbeatInterval.D(), k.ForgetAfter.D(), k.OfferTimeout.D())
	}
}

// TestRedactURL: a NATS URL's password or bare token never shows; nor does
// one in a URL the config refuses.
func TestRedactURL(t *testing.T) {
	for in, want := range map[string]string{
		"nats://u:hunter2@h:4222": "nats://u:xxxxx@h:4222",
		"nats://tok3n@h:4222":     "nats://xxxxx@h:4222",
		"nats://h:4222":           "nats://h:4222",
		"nats://u:hun%zz@h:1":     "xxxxx@h:1",
	} {
		if got := RedactURL(in); got != want {
			t.Errorf("RedactURL(%q) = %q, want %q", in, got, want)
		}
	}
	_, err := Parse([]byte("state_dir: /s\nadvertise_addr: \"h:1\"\ncluster:\n  urls: http://u:hunter2@x:1\n  secret_env: S\n"))
	if err == nil || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "cluster.urls[0]") {
		t.Fatalf("a refused URL with a password: %v", err)
	}
}
