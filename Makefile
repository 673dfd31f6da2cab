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
DAEMON_LIBS := -levent -levent_pthreads -lsqlite3 -ljansson -lseccomp -larchive -lzstd -lz -lpthread -lm

COMMON_SRC := $(wildcard src/common/*.c)
AGENT_SRC := $(wildcard src/agent/*.c)
BACKEND_SRC := $(wildcard src/backend/*.c)
IMAGE_SRC := $(wildcard src/image/*.c)
DAEMON_SRC := $(filter-out src/daemon/main.c,$(wildcard src/daemon/*.c))
LIB_SRC := $(wildcard src/lib/*.c)
CLI_SRC := $(wildcard src/cli/*.c)
UNIT_SRC := $(wildcard tests/unit/*.c)

obj = $(patsubst %.c,$(B)/obj/%.o,$(1))
COMMON_OBJ := $(call obj,$(COMMON_SRC))
CORE_OBJ := $(COMMON_OBJ) $(call obj,$(BACKEND_SRC) $(IMAGE_SRC) $(DAEMON_SRC))
LIB_OBJ := $(call obj,$(LIB_SRC)) $(COMMON_OBJ)

BINS := $(B)/bin/warrend $(B)/bin/warren $(B)/bin/warren-agent
LIBS := $(B)/lib/libwarren.a $(B)/lib/libwarren.so $(B)/lib/pkgconfig/warren.pc
UNIT_BINS := $(patsubst tests/unit/%.c,$(B)/tests/%,$(UNIT_SRC))

all: $(BINS) $(LIBS) $(UNIT_BINS)

$(B)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(SANFLAGS) -c $< -o $@

# The agent runs as PID 1 in every sandbox and VM guest: static, never sanitized,
# small (few pages touched per sandbox).
$(B)/agent-obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CSTD) -Os -g $(WARN) -MMD -MP -c $< -o $@

$(B)/bin/warren-agent: $(patsubst %.c,$(B)/agent-obj/%.o,$(AGENT_SRC) $(COMMON_SRC))
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
	$(CC) $(SANFLAGS) -shared -Wl,-soname,libwarren.so.0 -o $@ $^ -ljansson

$(B)/lib/pkgconfig/warren.pc: warren.pc.in
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(abspath $(B))|' -e 's|@INCLUDEDIR@|$(abspath include)|' $< > $@

$(B)/bin/warren: $(call obj,$(CLI_SRC)) $(B)/lib/libwarren.a
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ -ljansson -lm

# Unit tests link the whole core (daemon pieces included) and the client library.
$(B)/tests/%: $(B)/obj/tests/unit/%.o $(B)/lib/libwarren-core.a $(B)/lib/libwarren.a
	@mkdir -p $(dir $@)
	$(CC) $(SANFLAGS) -o $@ $^ $(DAEMON_LIBS)

test: all
	./tests/run --build $(B)

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

format-check:
	clang-format --dry-run -Werror $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-san

.PHONY: all test clean format format-check
-include $(shell find $(B) -name '*.d' 2>/dev/null)
