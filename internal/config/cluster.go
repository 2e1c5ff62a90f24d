package config

import (
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Cluster is the cluster: block (ours): brokers that answer each other's
// leases over NATS. Nil means single-broker mode, exactly the spec's. Only
// the gateway reads it; spawnd never talks to the network.
type Cluster struct {
	// URLs are the NATS servers, nats:// or tls://, one string or a list.
	URLs Strings `yaml:"urls"`
	// CredsFile is a NATS .creds file (user JWT and nkey seed).
	CredsFile string `yaml:"creds_file"`
	// NkeySeed / NkeySeedEnv is an nkey user seed ("SU…"), the value or the
	// name of an environment variable holding it.
	NkeySeed    string `yaml:"nkey_seed"`
	NkeySeedEnv string `yaml:"nkey_seed_env"`
	// User / PasswordEnv authenticate with a NATS user name and the name
	// of an environment variable holding its password (never the password
	// itself, nor in a URL: URLs appear in logs, redacted).
	User        string `yaml:"user"`
	PasswordEnv string `yaml:"password_env"`
	// TLSCA is a PEM file of the CA the NATS servers' certificates chain to.
	TLSCA string `yaml:"tls_ca"`
	// Secret / SecretEnv is the cluster secret every broker's messages are
	// sealed with (keys derived from it): a NATS client that does not hold
	// it can neither read them nor act as any principal.
	Secret    string `yaml:"secret"`
	SecretEnv string `yaml:"secret_env"`
	// SubjectPrefix starts every subject the brokers use.
	SubjectPrefix string `yaml:"subject_prefix"`
	// HeartbeatInterval is how often a broker says it is alive; a peer
	// silent for three intervals is unreachable.
	HeartbeatInterval core.Duration `yaml:"heartbeat_interval"`
	// ForgetAfter is how long a broker may stay unreachable before it
	// leaves the membership list (and unreachable_brokers).
	ForgetAfter core.Duration `yaml:"forget_after"`
	// OfferTimeout is how long a full broker waits for a peer to accept a
	// claim it offers (the spawn comes after the accept) before it offers
	// the claim to the next one.
	OfferTimeout core.Duration `yaml:"offer_timeout"`
}

// Cluster defaults and limits.
const (
	DefaultSubjectPrefix     = "nexus.broker"
	DefaultHeartbeatInterval = time.Second
	DefaultForgetAfter       = 24 * time.Hour
	DefaultOfferTimeout      = 250 * time.Millisecond
	// MinClusterSecret is the shortest cluster secret accepted, in bytes.
	MinClusterSecret = 32
)

// validateCluster checks the cluster: block and the keys cluster mode
// needs elsewhere in the file. Secrets named by <key>_env are read by the
// gateway (ResolveSecret), never here: spawnd reads this file too.
func (c *Config) validateCluster() error {
	k := c.Cluster
	if k == nil {
		return nil
	}
	if len(k.URLs) == 0 {
		return fmt.Errorf("broker config: cluster.urls: required; list the NATS servers, such as nats://nats-1.example.com:4222")
	}
	for i, u := range k.URLs {
		p, err := url.Parse(strings.TrimSpace(u))
		if err != nil || p.Host == "" || (p.Scheme != "nats" && p.Scheme != "tls") {
			return fmt.Errorf("broker config: cluster.urls[%d]: %q is not nats://host:port or tls://host:port", i, RedactURL(u))
		}
		if p.User != nil && k.User != "" {
			return fmt.Errorf("broker config: cluster.urls[%d]: carries a user as well as cluster.user, and neither wins; keep cluster.user and password_env", i)
		}
	}
	if (k.User == "") != (k.PasswordEnv == "") {
		return fmt.Errorf("broker config: cluster.user: user and password_env go together (the password is read from the variable password_env names); set both or neither")
	}
	if k.User != "" && (k.CredsFile != "" || k.NkeySeed != "" || k.NkeySeedEnv != "") {
		return fmt.Errorf("broker config: cluster.user: set together with cluster.creds_file or an nkey seed, and neither wins; keep one way to authenticate")
	}
	if k.PasswordEnv != "" {
		if err := checkSecret("cluster", "password", "", k.PasswordEnv); err != nil {
			return err
		}
	}
	if k.CredsFile != "" && (k.NkeySeed != "" || k.NkeySeedEnv != "") {
		return fmt.Errorf("broker config: cluster.creds_file: set together with cluster.nkey_seed or nkey_seed_env, and neither wins; keep one")
	}
	if k.NkeySeed != "" || k.NkeySeedEnv != "" {
		if err := checkSecret("cluster", "nkey_seed", k.NkeySeed, k.NkeySeedEnv); err != nil {
			return err
		}
	}
	if err := checkSecret("cluster", "secret", k.Secret, k.SecretEnv); err != nil {
		return err
	}
	if k.Secret != "" && len(k.Secret) < MinClusterSecret {
		return fmt.Errorf("broker config: cluster.secret: %d bytes is too short to sign with; use at least %d random bytes (openssl rand -hex 32), the same on every broker", len(k.Secret), MinClusterSecret)
	}
	if k.SubjectPrefix == "" {
		k.SubjectPrefix = DefaultSubjectPrefix
	}
	if !validSubject(k.SubjectPrefix) {
		return fmt.Errorf("broker config: cluster.subject_prefix: %q is not a NATS subject (dot-separated tokens of letters, digits, - and _); write one such as %s", k.SubjectPrefix, DefaultSubjectPrefix)
	}
	if k.HeartbeatInterval == 0 {
		k.HeartbeatInterval = core.Duration(DefaultHeartbeatInterval)
	}
	if k.HeartbeatInterval < core.Duration(10*time.Millisecond) {
		return fmt.Errorf("broker config: cluster.heartbeat_interval: %s is below 10ms; remove the key for the default %s", k.HeartbeatInterval.D(), DefaultHeartbeatInterval)
	}
	if k.ForgetAfter == 0 {
		k.ForgetAfter = core.Duration(DefaultForgetAfter)
	}
	// Forgetting a broker sooner than it is found unreachable would drop
	// one that merely missed a heartbeat.
	if k.ForgetAfter < 3*k.HeartbeatInterval {
		return fmt.Errorf("broker config: cluster.forget_after: %s is shorter than three heartbeat intervals (%s), after which a silent broker is only unreachable; use a longer one, or remove the key for the default %s", k.ForgetAfter.D(), 3*k.HeartbeatInterval.D(), DefaultForgetAfter)
	}
	if k.OfferTimeout == 0 {
		k.OfferTimeout = core.Duration(DefaultOfferTimeout)
	}
	if k.OfferTimeout < core.Duration(time.Millisecond) {
		return fmt.Errorf("broker config: cluster.offer_timeout: %s is below 1ms; remove the key for the default %s", k.OfferTimeout.D(), DefaultOfferTimeout)
	}
	// A broker's leases are addressed by its id for their whole life: an id
	// that changed at a restart would strand every one of them.
	if c.StateDir == "" {
		return fmt.Errorf("broker config: state_dir: required with cluster: (a broker's leases name it by broker_id, which must survive a restart, and a restarted broker recovers its leases from state_dir); set state_dir, or remove the cluster: block")
	}
	if c.BrokerID != "" && !core.IsToken(c.BrokerID, core.MaxBrokerIDLen) {
		return fmt.Errorf("broker config: broker_id: %q cannot name a broker in cluster mode: use 1 to %d letters, digits, - or _ (it is a NATS subject token and part of every lease id)", c.BrokerID, core.MaxBrokerIDLen)
	}
	if c.AdvertiseAddr == "" {
		return fmt.Errorf("broker config: advertise_addr: required with cluster: (peers and clients are handed this broker's address); write the host:port clients use to reach this broker")
	}
	return nil
}

// RedactURL is u with any password (or bare token) in it replaced by
// xxxxx: the form logs and errors show a NATS URL in.
func RedactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		// Unparseable: drop whatever comes before an @, where one may be.
		if at := strings.LastIndexByte(u, '@'); at >= 0 {
			return "xxxxx@" + u[at+1:]
		}
		return u
	}
	if p.User == nil {
		return u
	}
	if _, has := p.User.Password(); !has {
		p.User = url.User("xxxxx") // a bare token
		return p.String()
	}
	return p.Redacted()
}

func validSubject(s string) bool {
	for _, tok := range strings.Split(s, ".") {
		if !core.IsToken(tok, len(tok)) {
			return false
		}
	}
	return true
}
