# nexus-broker. `make run` starts the broker on its development defaults;
# `make test` runs every test. Both need only Go.
GO      ?= go
BIN     := bin
TOOLS   := $(BIN)/tools
PKGS    := ./...
# The binaries link no C: with Go's own resolver and user lookup, no process
# maps libc and the dynamic loader (~1.7 MiB resident each, see
# docs/performance.md). internal/e2e builds the binaries it tests the same way.
TAGS    := netgo,osusergo

.PHONY: build run buildnote stop cluster test lint bench fuzz chaos proto clean

build:
	$(GO) build -tags $(TAGS) -o $(BIN)/ ./cmd/...

# Starts nexus-broker with its embedded development defaults (nexus-spawnd is
# launched for you, nexus-echo is the nexus entry) unless ./broker.yaml exists.
run:
	@$(MAKE) --no-print-directory buildnote
	@$(MAKE) --no-print-directory build
	$(BIN)/nexus-broker

# What make run says before it builds: that the first build on a cold Go
# build cache takes about two minutes, or that only what changed is rebuilt.
buildnote:
	@sh tools/buildnote.sh "$(GO)" $(TAGS) ./cmd/nexus-broker ./cmd/nexus-spawnd ./cmd/nexus-echo

# Releases every lease of the nexus-spawnd `make run` uses (./broker.yaml's
# when there is one, else the development defaults'): what Ctrl-C of
# `make run` leaves running. That spawnd then exits on its own about 10 s
# later. Nothing running is not an error.
stop: build
	$(BIN)/nexus-broker -stop

# Three brokers in cluster mode on loopback, with an embedded nats-server;
# prints each broker's URL and what to try. Ctrl-C releases every lease and
# stops all of it.
cluster: build
	$(BIN)/nexus-cluster

test: lint
	$(GO) test -tags $(TAGS) -race -count=1 -timeout 20m $(PKGS)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) run honnef.co/go/tools/cmd/staticcheck $(PKGS)

# Benchmarks report ratios against baselines measured in the same run,
# including a 60 s soak. NEXUS_BENCH_BASE_BIN=<dir of another build's
# binaries> runs that build's broker beside this one (docs/performance.md);
# NEXUS_UPSTREAM_SRC=<a checkout of the upstream project's source> builds its
# nexus-broker and stock nexus engine, and runs the benchmarks that compare
# against them (NEXUS_UPSTREAM_BROKER and NEXUS_STOCK_NEXUS name built ones).
bench: build
	E2E_NORACE=1 $(GO) test -tags $(TAGS) -run '^$$' -bench . -benchtime 2s -timeout 45m ./internal/e2e/ ./internal/gateway/... ./internal/spawnd/ ./internal/auth/ ./internal/a2a/

# Chaos at scale, not part of make test: LEASES streaming leases through
# kill -9 of spawnd, of the gateway and of both, a SIGSTOPped spawnd and a
# state_dir whose disk fills (root: it mounts a tmpfs), printing what each
# lost (all zero) and the reattach and re-adoption times.
LEASES ?= 200
chaos:
	E2E_NORACE=1 NEXUS_CHAOS_LEASES=$(LEASES) $(GO) test -tags $(TAGS) -count=1 -v -run '^TestChaosAtScale$$' -timeout 60m ./internal/e2e/

# Short fuzzing of every decoder and the config loader, spawnd's verb
# handlers (a real Daemon, state_dir on /dev/shm) and its state files.
FUZZTIME ?= 30s
# An input that finds new coverage is minimized for at most this long (go
# test's default is 60 s, longer than a run: a worker minimizing a few
# hundred bytes of JSON would spend the rest of the run there, its
# executions never counted).
FUZZMINIMIZETIME ?= 5s
FUZZ = $(GO) test -run '^$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZETIME) -fuzz
fuzz:
	$(FUZZ) 'FuzzDecode$$' ./pkg/brokerframe
	$(FUZZ) 'FuzzDecodeFastAgrees$$' ./pkg/brokerframe
	$(FUZZ) 'FuzzParse$$' ./internal/config
	$(FUZZ) 'FuzzExtract$$' ./internal/auth
	$(FUZZ) 'FuzzParseTranscript$$' ./internal/echo
	$(FUZZ) 'FuzzPayloadType$$' ./internal/echo
	$(FUZZ) 'FuzzValidate$$' ./pkg/sessionid
	$(FUZZ) 'FuzzDecodeRecord$$' ./internal/a2a
	$(FUZZ) 'FuzzOwner$$' ./internal/cluster
	$(FUZZ) 'FuzzReceive$$' ./internal/cluster
	$(FUZZ) 'FuzzOpenSealed$$' ./internal/cluster
	$(FUZZ) 'FuzzMembersRecord$$' ./internal/cluster
	$(FUZZ) 'FuzzReadOnlyImage$$' ./internal/footprint
	$(FUZZ) 'FuzzTargetOf$$' ./internal/a2a/ingress
	$(FUZZ) 'FuzzDecodeRPCAgrees$$' ./internal/a2a
	$(FUZZ) 'FuzzRegister$$' ./internal/gateway
	$(FUZZ) 'FuzzParseTextRecord$$' ./internal/spawnclient
	$(FUZZ) 'FuzzCodecAgrees$$' ./pkg/spawnrpc/spawnpb
	$(FUZZ) 'FuzzHealthCodecAgrees$$' ./pkg/spawnrpc
	$(FUZZ) 'FuzzReadEndpoint$$' ./pkg/spawnrpc
	$(FUZZ) 'FuzzLaneFrame$$' ./pkg/spawnrpc
	$(FUZZ) 'FuzzJournalReplay$$' ./internal/spawnd
	$(FUZZ) 'FuzzSessionIndex$$' ./internal/spawnd
	$(FUZZ) 'FuzzVerbs$$' ./internal/spawnd

# Regenerates pkg/spawnrpc/spawnpb from spawn.proto with Debian's
# protobuf-compiler (apt-get install protobuf-compiler) and the plugin
# versions pinned in go.mod: protoc-gen-go, protoc-gen-go-grpc, and
# vtprotobuf's protoc-gen-go-vtproto (each message's reflection-free
# MarshalVT, UnmarshalVT and SizeVT, which spawnpb.Codec uses).
proto:
	$(GO) build -o $(TOOLS)/ google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc github.com/planetscale/vtprotobuf/cmd/protoc-gen-go-vtproto
	PATH="$(CURDIR)/$(TOOLS):$$PATH" protoc --go_out=. --go_opt=paths=source_relative \
		--go-grpc_out=. --go-grpc_opt=paths=source_relative \
		--go-vtproto_out=. --go-vtproto_opt=paths=source_relative,features=marshal+unmarshal+size \
		pkg/spawnrpc/spawnpb/spawn.proto

clean:
	rm -rf $(BIN)
