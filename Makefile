# Better Compute. `make dev` runs the control plane on SQLite; `make test` runs every test,
# the PostgreSQL suite included. See README.md.

CARGO ?= cargo
# The test build has the seeded fake machine (`bcd hardware --fake-hw`, `[hardware] fake_seed`),
# the libvirt hypervisor (tested against libvirt's `test:///default`) and the TPM (`bcd join
# --attestor tpm`, tested against swtpm); a release build (`cargo build --release`) leaves them out.
TEST_FEATURES ?= --features bc-agent/fakehw,bc-agent/libvirt,bc-agent/tpm
DEV_ARGS ?=

## CI (CI=true) builds once, from a clean checkout: incremental compilation's caches would be
## written for nothing, and they are more than half of target/ (13 of 23 GB after a full test
## build here); a CI run that filled its disk failed in the linker. So CI builds without them.
ifeq ($(CI),true)
export CARGO_INCREMENTAL := 0
endif

## CI builds the workspace through clippy: clippy-driver as cargo's workspace wrapper, as `cargo
## clippy` itself runs it, so one compile of each workspace crate is both its build and its lint
## (warnings as errors, the same clippy.toml bans), where `make lint`'s `cargo clippy` compiled
## every crate and dependency a second time, in check mode, beside the build. nextest's and the
## doctests' cargo get the same two variables, or they would build the workspace again. Outside
## CI, `make test` builds and lints apart (a later plain `cargo nextest run` then reuses the build).
ifeq ($(CI),true)
LINTED := RUSTC_WORKSPACE_WRAPPER="$$(rustup which clippy-driver)" CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
LINT_DEPS := fmt-check
else
LINTED :=
LINT_DEPS := lint
endif

.PHONY: dev test test-deps bench bench-deps lint fmt fmt-check build check-postgres schemathesis schemathesis-venv witness tiles-venv sushy-venv usage-venv health-venv fleet-venv system-deps sim sim-large ha-up ha-down test-ha

## Run the control plane on the embedded database (./.better-compute), nothing else to install.
## Built with the seeded fake machines, so `make dev DEV_ARGS='--sim 5'` starts five simulated
## machines in the same process (a first look at a working fleet).
dev:
	$(CARGO) run --bin better-compute --features bc-agent/fakehw -- dev $(DEV_ARGS)

## Every target of the workspace: the binaries the end-to-end tests start, the tests, and the
## benches (compiled, not run, so they cannot rot). The tests refuse a binary older than its sources.
## (`+`: cargo shares make's job slots when make runs jobs side by side, as `make test` does.)
build: system-deps
	+$(LINTED) $(CARGO) build --workspace --all-targets $(TEST_FEATURES)

## Debian packages a test build needs (libvirt-dev, pkg-config, qemu-utils, …), installed once.
system-deps:
	@scripts/system-deps

## Every test of the workspace, in one run: unit, conformance (SQLite and PostgreSQL),
## property, and end-to-end tests that start the real binaries, schemathesis testing the OpenAPI
## document from outside against a running `dev` among them. What the run needs is made first,
## side by side (one job per core and one more; both cargo builds share make's job slots, so the
## cores stay busy while a download or a C build runs alone): the workspace's build, the lint
## (`make lint`: rustfmt and clippy with the determinism bans, warnings as errors, so CI enforces
## that nothing in the simulated crates escapes the seed), siglog's witness, and the three Python
## virtual environments (pymerkle, sushy-tools, schemathesis).
## nextest runs no doctests, so the doctests (the `compile_fail` ones that prove only the `Log`
## appends among them) run after it, with `cargo test --doc` (the fallback leaves them to it);
## either failing fails the make.
## nextest runs two tests a core: most end-to-end tests spend their time waiting on a server, a
## BMC emulator or sshd, and with one a core the run was bound by its slots, not its cores
## (measured on 2 cores from a clean clone: 511 s with 2 at once, 416 s with 4, CPU 165 %; every
## test passed both ways). The simulator's many-seeds test runs two processes in its one slot:
## giving it two left the waiting tests fewer slots for the minutes it runs, which was not measured
## to help.
TEST_THREADS ?= $$(( $$(nproc) * 2 ))
test: check-postgres
	+@$(MAKE) --no-print-directory -j$$(( $$(nproc) + 1 )) test-deps
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(LINTED) $(CARGO) nextest run --workspace --no-fail-fast --test-threads $(TEST_THREADS) $(TEST_FEATURES); \
	else \
		echo "cargo-nextest not found; using cargo test"; \
		$(LINTED) $(CARGO) test --workspace --no-fail-fast --lib --bins --tests $(TEST_FEATURES); \
	fi
	$(LINTED) $(CARGO) test --workspace --doc $(TEST_FEATURES)

test-deps: build $(LINT_DEPS) witness tiles-venv sushy-venv schemathesis-venv usage-venv health-venv fleet-venv

## The third-party C2SP witness the witness test runs against: siglog's `witness` (crates.io,
## pinned). Installed once per machine, as the apt packages are, under the user's cache
## (~/.cache/better-compute/siglog-0.1.0, or $$XDG_CACHE_HOME's), and linked into target/tools/bin:
## it is a third party's program, not a build of this checkout, and building it (sea-orm, opendal,
## reqwest: 6 minutes of one core) beside every clean checkout's build took a core from the
## workspace's build for most of it. A second run, or a fresh clone on the same machine, finds it.
WITNESS_BIN := target/tools/bin/witness
WITNESS_HOME := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/better-compute/siglog-0.1.0
witness: $(WITNESS_BIN)
## Built unoptimised (`--debug`): it cosigns a few checkpoints in one test, and the release
## build took 7 of a clean `make test`'s 24 minutes on 2 cores (3 min this way).
## Half the cores (at least one): beside `make test`'s build it must not take every job slot, or
## the workspace's build (the longer) waits for it.
$(WITNESS_BIN):
	@if [ ! -x "$(WITNESS_HOME)/bin/witness" ]; then \
		echo "installing siglog's witness under $(WITNESS_HOME) (once per machine)"; \
		$(CARGO) install siglog --version 0.1.0 --locked --bin witness --root "$(WITNESS_HOME)" --debug -j $$(( ($$(nproc) + 1) / 2 )); \
	fi
	mkdir -p $(dir $@)
	ln -sfn "$(WITNESS_HOME)/bin/witness" $@

## A Python virtual environment of a test's outside checkers: $(call python_venv,DIR,REQUIREMENTS)
## makes DIR/installed-requirements.txt, the venv made once and again only when REQUIREMENTS
## changes (the pins are in the file).
define python_venv
$(1)/installed-requirements.txt: $(2)
	rm -rf $(1)
	python3 -m venv $(1)
	$(1)/bin/python -m pip install --quiet --disable-pip-version-check --no-input -r $(2)
	cp $(2) $$@
endef

## The third-party RFC 6962 implementation the tiles test checks the served tiles with: pymerkle
## (PyPI, pinned in tests/scripts/tiles-requirements.txt) in a virtual environment of its own,
## target/tiles-venv/, made once and again only when that file changes.
TILES_VENV := target/tiles-venv
TILES_REQUIREMENTS := tests/scripts/tiles-requirements.txt
tiles-venv: $(TILES_VENV)/installed-requirements.txt
$(eval $(call python_venv,$(TILES_VENV),$(TILES_REQUIREMENTS)))

## The usage test's outside checkers: the FinOps Foundation's focus-validator and the CloudEvents
## SDK (PyPI, pinned in tests/scripts/usage-requirements.txt) in a virtual environment of its own,
## target/usage-venv/, made once and again only when that file changes.
USAGE_VENV := target/usage-venv
USAGE_REQUIREMENTS := tests/scripts/usage-requirements.txt
usage-venv: $(USAGE_VENV)/installed-requirements.txt
$(eval $(call python_venv,$(USAGE_VENV),$(USAGE_REQUIREMENTS)))

## The BMC the Redfish test drives the real client against: OpenStack's sushy-tools emulator (PyPI,
## pinned in tests/scripts/sushy-requirements.txt, its fake system driver) in a virtual environment
## of its own, target/sushy-venv/, made once and again only when that file changes.
SUSHY_VENV := target/sushy-venv
SUSHY_REQUIREMENTS := tests/scripts/sushy-requirements.txt
sushy-venv: $(SUSHY_VENV)/installed-requirements.txt
$(eval $(call python_venv,$(SUSHY_VENV),$(SUSHY_REQUIREMENTS)))

## The agents' endpoint's outside gRPC clients the health test runs (grpcio-health-checking and
## grpcio-reflection, PyPI, pinned in tests/scripts/health-requirements.txt) in a virtual
## environment of its own, target/health-venv/, made once and again only when that file changes.
HEALTH_VENV := target/health-venv
HEALTH_REQUIREMENTS := tests/scripts/health-requirements.txt
health-venv: $(HEALTH_VENV)/installed-requirements.txt
$(eval $(call python_venv,$(HEALTH_VENV),$(HEALTH_REQUIREMENTS)))

## The fleet test's outside checker: Python's jsonschema (PyPI, pinned in
## tests/scripts/fleet-requirements.txt), which validates exported FleetConfig documents against
## the checked-in schema, in a virtual environment of its own, target/fleet-venv/.
FLEET_VENV := target/fleet-venv
FLEET_REQUIREMENTS := tests/scripts/fleet-requirements.txt
fleet-venv: $(FLEET_VENV)/installed-requirements.txt
$(eval $(call python_venv,$(FLEET_VENV),$(FLEET_REQUIREMENTS)))

## The PostgreSQL suite never skips: without a server the run stops here and says how to get one.
check-postgres:
	@scripts/check-postgres

## The OpenAPI document tested from the outside: schemathesis (pinned, in a virtual environment of
## its own under target/schemathesis/) against a fresh `better-compute dev`, every check on; `make
## test` runs it as one of its tests (tests/tests/schemathesis.rs), this runs it alone.
## SCHEMATHESIS_SEED and SCHEMATHESIS_MAX_EXAMPLES override the seed and the examples per operation.
schemathesis: build
	scripts/schemathesis

## That virtual environment alone (the script makes it again when its pins change).
schemathesis-venv:
	@scripts/schemathesis --install-only

## Many seeds of the simulator (`better-compute sim run`, release build), two at a time, every
## fault on: SEEDS seeds from SIM_SEED_FROM, each SIM_NODES nodes, SIM_TENANTS tenants,
## SIM_HOURS simulated hours. Each seed's line says its steps, wall time, when it settled and its
## digest; a failing seed prints its command and stops the run.
SEEDS ?= 100
SIM_SEED_FROM ?= 1
SIM_NODES ?= 50
SIM_TENANTS ?= 5
SIM_HOURS ?= 1
sim:
	$(CARGO) build --release --bin better-compute
	seq $(SIM_SEED_FROM) $$(( $(SIM_SEED_FROM) + $(SEEDS) - 1 )) | xargs -P 2 -I SEED sh -c \
		'target/release/better-compute sim run --cpu $$(( SEED % $$(nproc) )) --seed SEED --nodes $(SIM_NODES) --tenants $(SIM_TENANTS) --hours $(SIM_HOURS) > target/sim-SEED.txt 2>&1 \
		&& echo "seed SEED: $$(grep -e ^steps -e ^liveness -e ^digest target/sim-SEED.txt | paste -s -d, -)" \
		|| { cat target/sim-SEED.txt; exit 255; }'

## The simulator at a real fleet's size (release build): seeds 1 to 3 at 1,000 nodes and 10
## tenants, every fault, two at a time (about 1.5 minutes and 550 MB each on 2 cores). `make
## sim`'s variables set it otherwise: `make sim-large SIM_NODES=2000 SIM_TENANTS=20`.
sim-large: SEEDS = 3
sim-large: SIM_SEED_FROM = 1
sim-large: SIM_NODES = 1000
sim-large: SIM_TENANTS = 10
sim-large: sim

## The high-availability layout on this machine (docs/high-availability.md), in target/ha (HA_DIR):
## etcd, three PostgreSQL members under Patroni (synchronous, strict), two `serve` behind HAProxy.
## Installs etcd-server, patroni and haproxy once. HA_PORT_BASE, HA_TTL, … as scripts/ha-up says.
ha-up:
	$(CARGO) build --workspace --bins $(TEST_FEATURES)
	scripts/ha-up

ha-down:
	scripts/ha-down

## The failover tests on that layout alone (tests/tests/ha.rs, which `make test` runs with the rest
## of the suite), one at a time, their output shown: 16 writers, the primary killed three times;
## the negative control with synchronous_commit = local; and the one-kill reconcilers test.
## BC_HA_TTL=30 BC_HA_LOOP_WAIT=10 BC_HA_RETRY_TIMEOUT=10 runs them on Patroni's default timings
## (tuned: 10, 2, 4).
test-ha: check-postgres
	$(CARGO) build --workspace --bins $(TEST_FEATURES)
	$(CARGO) nextest run --workspace $(TEST_FEATURES) --test-threads 1 --no-fail-fast --no-capture -E 'test(/^ha::/)'

## What the benches need from Debian: etcd-server, the watch bench's baseline, installed once.
bench-deps:
	@scripts/bench-deps

## Benchmarks (release build); prints tables of ratios against baselines measured in the same run.
## One binary (cli/benches/main.rs) runs the benches named, each in a child process of its own,
## in this order; the first that fails stops the rest. One alone:
## `cargo bench -p bc-cli --bench benches -- usage`.
## The watch bench starts etcd (bench-deps) beside the gateway. The fleet bench runs `bcd sim`, so
## target/release/bcd is left a fakehw build (BC_BENCH_AGENTS, BC_BENCH_RESERVES change its sizes).
## The tunnels bench runs that `bcd` too, beside a release `dev`: `forward`'s throughput against
## raw loopback TCP, a console keystroke's round trip, and the gateway's memory per open tunnel.
## The sim bench prints `sim run`'s simulated node-hours per wall-clock second at 1,000 nodes
## beside the goal (100× real time), and replay's events per second beside the raw append rate
## (BC_BENCH_SIM_NODES, BC_BENCH_SIM_TENANTS, BC_BENCH_SIM_HOURS).
## The batches bench runs that `bcd` too (`bcd sim`, 100 agents): a batch of 10,000 pings created,
## reviewed, approved and released against the same commands issued one by one (BC_BENCH_LEAVES).
## The sandboxes bench runs that `bcd` too, with gVisor (runsc, busybox-static: make system-deps):
## create → first exec output, cold and from a warm pool, beside `runsc do /bin/true` as the floor,
## and how many 64 MiB sandboxes one node runs before something says no.
## The usage bench closes windows over 1,000,000 reservation events in memory beside the raw append
## rate, then times `usage export` (rows/s, peak RSS by /usr/bin/time -v) against a release `dev`.
## The ha_writes bench brings up scripts/ha-up's cluster (etcd, three Patroni members, two `serve`,
## HAProxy; installs etcd-server, patroni, haproxy once) on ports from 25900 and one plain
## PostgreSQL beside it: writes through the two gateways against one gateway on the plain server.
bench: check-postgres bench-deps
	$(CARGO) build --release -p bc-agent --features fakehw --bin bcd
	$(CARGO) bench -p bc-cli --bench benches -- append audit watch api_writes metrics log_growth webhooks reservations unknown_method agents fleet batches fleet_config sim tunnels sandboxes usage ha_writes

## fmt, and clippy on every target with the test build's features (the agent's fakehw and
## libvirt code too), warnings as errors. clippy.toml at the root bans the wall clock, unseeded
## randomness and fresh ULIDs in the crates the simulator runs (nothing escapes the seed); the
## crates outside it (cli, gateway, proto, tests) have their own clippy.toml without the bans.
lint: fmt-check
	$(CARGO) clippy --workspace --all-targets $(TEST_FEATURES) -- -D warnings

fmt-check: system-deps
	$(CARGO) fmt --all --check

fmt:
	$(CARGO) fmt --all
