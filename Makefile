# Warren build. `make` builds binaries and libraries into build/, `make test`
# runs the whole suite, `make SAN=1` builds an ASan+UBSan variant into build-san/.
CC ?= cc
SAN ?= 0
ifeq ($(SAN),1)
B ?= build-san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
OPT := -O1 -g
else
B ?= build
SANFLAGS :=
OPT := -O2 -g
endif

CSTD := -std=gnu11
WARN := -Wall -Wextra -Werror -Wno-unused-parameter -Wno-format-truncation -Wshadow=local -Wformat=2
CPPFLAGS += -D_GNU_SOURCE -Iinclude -Isrc
CFLAGS += $(CSTD) $(OPT) $(WARN) -fPIC -MMD -MP
DAEMON_LIBS := -levent -levent_pthreads -lsqlite3 -ljansson -lseccomp -larchive -lzstd -lz -lcurl -lssl -lcrypto -lnftables -lpthread -lm

# httpd.c (the hardened TCP listener, libevent) serves warrend and warren-gateway only
HTTPD_SRC := src/common/httpd.c
COMMON_SRC := $(filter-out $(HTTPD_SRC),$(wildcard src/common/*.c))
AGENT_SRC := $(wildcard src/agent/*.c)
BACKEND_SRC := $(wildcard src/backend/*.c)
IMAGE_SRC := $(wildcard src/image/*.c)
DAEMON_SRC := $(filter-out src/daemon/main.c,$(wildcard src/daemon/*.c))
LIB_SRC := $(wildcard src/lib/*.c)
CLI_SRC := $(wildcard src/cli/*.c)
UNIT_SRC := $(wildcard tests/unit/*.c)
# cluster mode (docs/cluster.md): the etcd client is linked into warrend and warren-gateway
CLUSTER_SRC := $(wildcard src/cluster/*.c)
GATEWAY_SRC := $(wildcard src/gateway/*.c)

obj = $(patsubst %.c,$(B)/obj/%.o,$(1))
COMMON_OBJ := $(call obj,$(COMMON_SRC))
CORE_OBJ := $(COMMON_OBJ) $(call obj,$(HTTPD_SRC) $(BACKEND_SRC) $(IMAGE_SRC) $(DAEMON_SRC) $(CLUSTER_SRC))
# libwarren's own copies of its objects and of src/common, compiled with
# hidden visibility: libwarren.so exports only what include/warren/warren.h
# marks WARREN_EXPORT (the daemon's objects keep the default).
LIB_OBJ := $(patsubst %.c,$(B)/lib-obj/%.o,$(LIB_SRC) $(COMMON_SRC))

BINS := $(B)/bin/warrend $(B)/bin/warren $(B)/bin/warren-agent $(B)/bin/warren-gateway \
	$(B)/bin/warren-sim
LIBS := $(B)/lib/libwarren.a $(B)/lib/libwarren.so $(B)/lib/pkgconfig/warren.pc
UNIT_BINS := $(patsubst tests/unit/%.c,$(B)/tests/%,$(UNIT_SRC))
# the Python SDK as a pure-Python wheel, built with the standard library only
# (scripts/mk-wheel.py): no network, no `wheel` package
WHEEL := $(B)/warren-$(shell sed -n 's/^version = "\(.*\)"/\1/p' python/pyproject.toml)-py3-none-any.whl

all: $(BINS) $(LIBS) $(UNIT_BINS) $(WHEEL)

$(B)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(SANFLAGS) -c $< -o $@

$(B)/lib-obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -fvisibility=hidden $(SANFLAGS) -c $< -o $@

# The agent runs as PID 1 in every sandbox and VM guest: static, never sanitized,
# small (few pages touched per sandbox).
$(B)/agent-obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CSTD) -Os -g $(WARN) -MMD -MP -c $< -o $@

# src/backend/child.c: the sandbox setup its zygote children run (docs/containers.md)
$(B)/bin/warren-agent: $(patsubst %.c,$(B)/agent-obj/%.o,$(AGENT_SRC) $(COMMON_SRC) src/backend/child.c)
	@mkdir -p $(dir $@)
	$(CC) -static -o $@ $^ -ljansson

$(B)/lib/libwarren-core.a: $(CORE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(B)/bin/warrend: $(call obj,src/daemon/main.c) $(B)/lib/libwarren-core.a
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ $(DAEMON_LIBS)

$(B)/lib/libwarren.a: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(B)/lib/libwarren.so: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -shared -Wl,-soname,libwarren.so.0 -o $@ $^ -ljansson -larchive

$(B)/lib/pkgconfig/warren.pc: warren.pc.in
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(abspath $(B))|' -e 's|@LIBDIR@|$${prefix}/lib|' \
	  -e 's|@INCLUDEDIR@|$(abspath include)|' -e 's|@VERSION@|$(LIBVERSION)|' $< > $@

$(B)/bin/warren: $(call obj,$(CLI_SRC)) $(B)/lib/libwarren.a
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ -ljansson -larchive -lm

# The cluster gateway: no root, no sandboxes; libevent, jansson and the etcd client.
$(B)/bin/warren-gateway: $(call obj,$(GATEWAY_SRC) $(CLUSTER_SRC) $(HTTPD_SRC) src/image/sha256.c) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ -levent -levent_pthreads -ljansson -lssl -lcrypto -lpthread

# Simulated nodes for scale tests (docs/cluster.md): the etcd client and the
# membership records warrend publishes, no sandboxes.
$(B)/bin/warren-sim: $(call obj,src/sim/main.c $(CLUSTER_SRC)) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ -levent -levent_pthreads -ljansson -lssl -lcrypto -lpthread

$(WHEEL): scripts/mk-wheel.py python/pyproject.toml python/README.md $(wildcard python/warren/*)
	python3 scripts/mk-wheel.py python $(B) >/dev/null

wheel: $(WHEEL)

# ---- make install PREFIX=/usr/local DESTDIR= (docs/operations.md, "Install") ----
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
DATADIR ?= $(PREFIX)/share/warren
SYSTEMDUNITDIR ?= $(PREFIX)/lib/systemd/system
LIBVERSION := $(shell sed -n 's/^\#define WARREN_VERSION "\(.*\)"/\1/p' include/warren/version.h)

install: $(BINS) $(LIBS) $(WHEEL)
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)/warren \
	  $(DESTDIR)$(DATADIR)/scripts $(DESTDIR)$(SYSTEMDUNITDIR)
	install -m755 $(BINS) $(DESTDIR)$(BINDIR)/
	install -m644 $(B)/lib/libwarren.a $(DESTDIR)$(LIBDIR)/
	install -m755 $(B)/lib/libwarren.so $(DESTDIR)$(LIBDIR)/libwarren.so.$(LIBVERSION)
	ln -sf libwarren.so.$(LIBVERSION) $(DESTDIR)$(LIBDIR)/libwarren.so.0
	ln -sf libwarren.so.0 $(DESTDIR)$(LIBDIR)/libwarren.so
	install -m644 include/warren/*.h $(DESTDIR)$(INCLUDEDIR)/warren/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' \
	  -e 's|@VERSION@|$(LIBVERSION)|' warren.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/warren.pc
	install -m755 scripts/mk-debian-rootfs.sh scripts/mk-lang-rootfs.sh scripts/mk-layer-diff.py \
	  $(DESTDIR)$(DATADIR)/scripts/
	install -m644 $(WHEEL) $(DESTDIR)$(DATADIR)/
	sed -e 's|@BINDIR@|$(BINDIR)|g' deploy/systemd/warrend-single.service \
	  > $(DESTDIR)$(SYSTEMDUNITDIR)/warrend.service

# Unit tests link the whole core (daemon pieces included) and the client library.
$(B)/tests/%: $(B)/obj/tests/unit/%.o $(B)/lib/libwarren-core.a $(B)/lib/libwarren.a
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ $(DAEMON_LIBS)

# test_client reads libwarren.so's exported symbols and runs both --version.
$(B)/tests/test_client: | $(B)/lib/libwarren.so $(B)/bin/warren $(B)/bin/warrend

test: all
	./tests/run --build $(B) $(TEST_ARGS)

# ---- fuzzing (docs/fuzzing.md) ----
# libFuzzer targets tests/fuzz/fuzz_NAME.c, built with clang into build-fuzz/ (or
# into B when B is given with only fuzz goals: `make fuzz B=build-me-fuzz`; a
# B shared with a gcc build would get clang objects).
# `make fuzz` runs each for FUZZ_SECONDS from its seed corpus tests/fuzz/corpus/NAME/.
FUZZ_CC ?= clang
FUZZ_ONLY := $(and $(MAKECMDGOALS),$(if $(filter-out fuzz fuzz-build,$(MAKECMDGOALS)),,1))
FB := $(if $(and $(FUZZ_ONLY),$(filter command line environment,$(origin B))),$(B),build-fuzz)
FUZZ_SECONDS ?= 20
FUZZ_SAN := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS := $(CSTD) -O1 -g $(FUZZ_SAN) -fsanitize=fuzzer-no-link -Wall -Wextra -Wno-unused-parameter -MMD -MP
FUZZ_NAMES := $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_BINS := $(patsubst %,$(FB)/fuzz_%,$(FUZZ_NAMES))
fuzzobj = $(patsubst %.c,$(FB)/obj/%.o,$(1))

# Project sources: warnings shown, not fatal (gcc is their compiler of record).
$(FB)/obj/src/%.o: src/%.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) $(FUZZ_CFLAGS) -c $< -o $@

# Fuzz targets: -Werror. They may #include a source file to reach its statics.
$(FB)/obj/tests/fuzz/%.o: tests/fuzz/%.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) $(FUZZ_CFLAGS) -Werror -c $< -o $@

$(FB)/libfuzz-core.a: $(call fuzzobj,$(COMMON_SRC) $(HTTPD_SRC) $(BACKEND_SRC) $(IMAGE_SRC) $(DAEMON_SRC) $(CLUSTER_SRC) $(LIB_SRC))
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(FB)/fuzz_%: $(FB)/obj/tests/fuzz/fuzz_%.o $(FB)/obj/tests/fuzz/harness.o $(FB)/libfuzz-core.a
	$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $(filter %.o,$^) $(filter %.a,$^) $(DAEMON_LIBS)

# fuzz_agent includes src/agent/main.c and exec.c for their statics.
$(FB)/fuzz_agent: $(call fuzzobj,$(filter-out src/agent/main.c src/agent/exec.c,$(AGENT_SRC)))

.SECONDARY: $(call fuzzobj,$(wildcard tests/fuzz/*.c))

fuzz-build: $(FUZZ_BINS)

# Absolute corpus and artifact paths: a target that changes its working
# directory (fuzz_agent runs FILE ops for real) made libFuzzer exit with
# "No such file or directory: build-fuzz/corpus/agent" when it next saved an
# input, which is how CI's fuzz_agent failed.
fuzz: fuzz-build
	@failed=; for t in $(FUZZ_NAMES); do \
	  mkdir -p $(FB)/corpus/$$t $(FB)/artifacts; \
	  echo "fuzz: $$t for $(FUZZ_SECONDS)s"; \
	  dict=; [ -f tests/fuzz/$$t.dict ] && dict=-dict=$(CURDIR)/tests/fuzz/$$t.dict; \
	  if $(FB)/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	    -print_final_stats=1 -artifact_prefix=$(abspath $(FB))/artifacts/$$t- $$dict \
	    $(abspath $(FB))/corpus/$$t $(CURDIR)/tests/fuzz/corpus/$$t 2>$(FB)/$$t.log; then \
	    grep -E '^stat::number_of_executed_units' $(FB)/$$t.log; \
	  else \
	    tail -n 60 $(FB)/$$t.log; echo "fuzz: $$t FAILED (log $(FB)/$$t.log)"; failed="$$failed $$t"; \
	  fi; \
	done; \
	if [ -n "$$failed" ]; then \
	  for t in $$failed; do \
	    echo "fuzz: $$t: why (the first report lines, then each input base64'd to replay)"; \
	    grep -E -m 12 'ERROR|SUMMARY|deadly|Timeout|timeout|out-of-memory|leak|^    #[0-9]' $(FB)/$$t.log; \
	    for a in $(FB)/artifacts/$$t-*; do [ -f "$$a" ] || continue; \
	      echo "fuzz: input $$a:"; head -c 4096 "$$a" | base64 -w 0; echo; done; \
	  done; \
	  echo "fuzz: failed:$$failed (inputs in $(FB)/artifacts/)"; exit 1; fi

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

format-check:
	clang-format --dry-run -Werror $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-san

.PHONY: all test clean format format-check fuzz fuzz-build wheel install
-include $(shell find $(B) -name '*.d' 2>/dev/null)
-include $(shell find $(FB) -name '*.d' 2>/dev/null)
