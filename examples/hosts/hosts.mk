# examples/hosts/hosts.mk — distopt dropped into two real C training loops from Debian's archive:
# FANN (libfann-dev) and darknet (darknet). Included from the top-level Makefile after it defines
# BUILD, CC, ALL_CFLAGS, LIBS and HEADERS (and its $(BUILD) directory rule).
#   make hosts   install the hosts' packages when missing (scripts/install-deps.sh hosts), build
#                BUILD/fann_dp and BUILD/darknet_dp, and run examples/hosts/run.sh: 1 process
#                against 2 workers over shm and over TCP, accuracy, bitwise-identical replicas
#                and the count of inserted lines, as a table; fails on any miss.

# Debian installs libdarknet.so and darknet.h outside the default search paths.
DARKNET_DIR ?= /usr/lib/darknet
HOST_BINS   := $(BUILD)/fann_dp $(BUILD)/darknet_dp

.PHONY: hosts hosts-deps

hosts: $(HOST_BINS)
	@examples/hosts/run.sh $(BUILD)

hosts-deps:
	@scripts/install-deps.sh hosts

# Order-only: the packages are there before the first compile, and never force a rebuild.
$(BUILD)/fann_dp: examples/hosts/fann_dp.c examples/fashion_mnist.h examples/hosts/host_common.h $(HEADERS) | hosts-deps $(BUILD)
	$(CC) $(ALL_CFLAGS) -I. -o $@ $< $(LIBS) -lfloatfann -lz

$(BUILD)/darknet_dp: examples/hosts/darknet_dp.c examples/fashion_mnist.h examples/hosts/host_common.h $(HEADERS) | hosts-deps $(BUILD)
	$(CC) $(ALL_CFLAGS) -I. -I$(DARKNET_DIR)/include -o $@ $< \
		-L$(DARKNET_DIR) -Wl,-rpath,$(DARKNET_DIR) -ldarknet $(LIBS) -lz
