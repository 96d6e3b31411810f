# distopt — header-only; this Makefile builds and runs its tests, benchmarks and examples.
#   make          build everything
#   make test     install missing Debian packages, build, run every test (the README's command)
#   make asan     the tests again under AddressSanitizer + UndefinedBehaviorSanitizer (with
#                 float-cast-overflow: a float out of an integer's range is an error too)
#   make bench    benchmarks (single-threaded kernels, compression, allreduce against MPI; as root
#                 the compressed allreduce also runs over a 1 Gbit/s veth link between namespaces,
#                 and allreduce across 4 simulated hosts: bench/cluster.sh)
#   make bench-overlap  buckets averaged during backward against blocking steps, on 2 and 4
#                 simulated hosts (root: bench/overlap.sh)
#   make cluster-test  the simulated-cluster and launcher checks alone (root): 8 ranks on 4 hosts
#                 over TCP from DOPT_* and torchrun's variables, test_mpi and TCP under mpirun
#                 across them, srun on a local Slurm (tests/check_cluster*.sh, check_slurm.sh)
#   make fuzz     run every fuzz target for FUZZ_SECONDS (default 60) each
#   make mutate   one-line mutations of the headers, each of which the tests must catch
#   make faults-soak  test_faults with FAULT_SOAK (default 10) times its kill trials
#   make demo     two workers on Fashion-MNIST: fp32 against TernGrad + local SGD (README)
#   make hosts    FANN and darknet from Debian with distopt in their loops (examples/hosts)
#   make experiments  the measurements of docs/RESULTS.md and its tables and figures (4-11 min)
#   make install PREFIX=/usr/local / make uninstall

PREFIX  ?= /usr/local
BUILD   ?= build
CC      ?= cc
CXX     ?= c++
MPICC   ?= mpicc
OPT     ?= -O2 -march=native -g
WARN    := -Wall -Wextra -Wpedantic -Werror
# The transports use POSIX and Linux calls, hidden by strict -std=c11 without a feature macro.
DEFS    := -D_GNU_SOURCE
CSTD    := -std=c11
CXXSTD  := -std=c++11
BLAS_CFLAGS := $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS   := $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)
# distopt.h's axpy and scale through OpenBLAS (a host without BLAS defines nothing and links nothing)
BLAS_CFLAGS += -DDOPT_USE_BLAS
ALL_CFLAGS  := $(CSTD) $(WARN) $(OPT) $(DEFS) $(BLAS_CFLAGS) $(CFLAGS)
LIBS        := $(BLAS_LIBS) -lm -lpthread -lrt

HEADERS  := $(wildcard distopt.h engine.h transport_*.h clip.h compress.h localsgd.h launch.h)
TEST_SRC := $(filter-out tests/test_mpi%.c tests/test_openmp.c,$(wildcard tests/test_*.c))
MPI_TEST_SRC := $(wildcard tests/test_mpi*.c)
TESTS    := $(patsubst tests/%.c,$(BUILD)/%,$(TEST_SRC))
MPI_TESTS := $(patsubst tests/%.c,$(BUILD)/%,$(MPI_TEST_SRC))
CHECKS   := $(BUILD)/check_two_units $(BUILD)/check_cxx $(BUILD)/check_define_inline \
            $(BUILD)/check_mpi_c $(BUILD)/check_mpi_cxx $(BUILD)/check_mpi_define_inline
# The core once more without OpenBLAS and without vector types: the portable loops users of
# other compilers get.
TESTS    += $(BUILD)/test_core_portable
# The integer ring's portable kernels, on the same worlds as its vector ones, and built without
# threads: its pipeline then runs on the caller's thread alone.
TESTS    += $(BUILD)/test_ring_portable
# compress.h once more with multiply-adds fused wherever the compiler likes (GCC's GNU-mode
# default; clang fuses within expressions): the error-feedback residual must stay exact.
TESTS    += $(BUILD)/test_compress_fused
# And with clang, which fuses within an expression by default: the vector and portable paths of
# every codec must still give the same bits.
TESTS    += $(BUILD)/test_compress_clang
# PowerSGD once more without OpenBLAS (its products as plain loops) and with multiply-adds fused
# wherever the compiler likes: the residual E = M − M̂ must stay exact there too.
TESTS    += $(BUILD)/test_powersgd_portable
# The driver's gradient buckets built without threads: they then run in after_backward, with the
# same results.
TESTS    += $(BUILD)/test_overlap_nothreads
# The host-sharing warning exists only where the implementation is built with OpenMP.
TESTS    += $(BUILD)/test_openmp
# The modules whose checks must hold in hosts built with flags we do not choose, once with GCC's
# -Ofast and once with clang's -O2 -ffast-math: the compiler may then assume no NaN and no
# infinity, so NaN and infinity are found by their bits (make asan leaves these out).
FAST_MATH_TESTS := $(foreach t,compress powersgd clip localsgd nonfinite,$(BUILD)/test_$(t)_ofast $(BUILD)/test_$(t)_clang_fastmath)
# The tests write a vector segment in the short form {offset, count, name} (rows, the fourth
# field, left 0 on purpose), which -Wextra's missing-field-initializers flags: off for the tests
# only. Examples, benchmarks and the headers build with every warning, as users' code may.
$(TESTS) $(FAST_MATH_TESTS) $(MPI_TESTS): ALL_CFLAGS += -Wno-missing-field-initializers
BENCH_SRC := $(filter-out bench/bench_allreduce.c,$(wildcard bench/bench_*.c))
BENCHES  := $(patsubst bench/%.c,$(BUILD)/%,$(BENCH_SRC))

EXAMPLES := $(BUILD)/least_squares $(BUILD)/fmnist_mlp $(BUILD)/perf_model $(BUILD)/char_lstm $(BUILD)/elastic_sgd
# llm.c's shape with distopt's synchronous drop-in, built with OpenMP as llm.c is
OMP_EXAMPLES := $(BUILD)/gpt2_standin
FUZZ_SRC := $(wildcard fuzz/fuzz_*.c)
FUZZERS  := $(patsubst fuzz/%.c,$(BUILD)/%,$(FUZZ_SRC))
FUZZ_SECONDS ?= 60

.PHONY: all deps test asan bench fuzz demo experiments examples install uninstall clean mutate cluster-test faults-soak

TOOLS    := $(BUILD)/distopt-inspect

all: $(TESTS) $(FAST_MATH_TESTS) $(MPI_TESTS) $(CHECKS) $(BENCHES) $(BUILD)/bench_allreduce $(EXAMPLES) $(OMP_EXAMPLES) $(TOOLS)

deps:
	@scripts/install-deps.sh

# Two workers train an MLP on Fashion-MNIST: fp32 against TernGrad + local SGD + clipping.
demo: deps $(BUILD)/fmnist_mlp
	@examples/demo.sh $(BUILD)

# TernGrad, adaptive batches, 1 and 2 workers, bytes per method and the performance model on
# Fashion-MNIST (and CELGC on a character LSTM): CSVs in $(BUILD)/experiments, docs/RESULTS.md, docs/img.
experiments: deps $(BUILD)/fmnist_mlp $(BUILD)/perf_model
	@experiments/run.sh $(BUILD) docs

examples: $(EXAMPLES) $(OMP_EXAMPLES)

# test_faults' kills, FAULT_SOAK times as many (a rare wrong or late survivor shows); not part of make test.
FAULT_SOAK ?= 10
faults-soak: $(BUILD)/test_faults
	@FAULT_SOAK=$(FAULT_SOAK) DTEST_TIMEOUT_S=86400 $(BUILD)/test_faults

# Local SGD surviving a killed worker: 20 trials over TCP on loopback, then one below min_ranks
# (tests/elastic_trials.c), 20 of the Fashion-MNIST MLP (fmnist_mlp --elastic on), the same two
# over shared memory, and the same on the simulated cluster, 4 hosts (root; about eight minutes
# in all). .ci/run runs it.
.PHONY: elastic-test
elastic-test: deps $(BUILD)/elastic_trials $(BUILD)/elastic_sgd $(BUILD)/fmnist_mlp $(BUILD)/bench_rejoin
	@$(BUILD)/elastic_trials $(BUILD) 20
	@OPENBLAS_NUM_THREADS=1 $(BUILD)/elastic_trials $(BUILD) 20 - mlp
	@$(BUILD)/elastic_trials $(BUILD) 20 shm
	@OPENBLAS_NUM_THREADS=1 $(BUILD)/elastic_trials $(BUILD) 20 shm mlp
	@tests/elastic_cluster.sh $(BUILD) 20

$(BUILD)/elastic_trials: tests/elastic_trials.c | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ $<

# One rank of tests/check_keepalive.sh's jobs (a host that goes silent).
$(BUILD)/silent_host: tests/silent_host.c $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

# One-line bugs the tests must catch (tests/mutate.sh lists them); slow, not part of make test.
mutate: deps
	@tests/mutate.sh

test: deps
	@$(MAKE) --no-print-directory all
	@tests/run.sh $(BUILD)

asan: deps
	@$(MAKE) --no-print-directory BUILD=build-asan OPT="-O1 -g -fsanitize=address,undefined,float-cast-overflow -fno-omit-frame-pointer -fno-sanitize-recover=undefined,float-cast-overflow" \
		build-asan-tests
	@ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/run.sh build-asan

cluster-test: deps
	@if [ "$$(id -u)" -ne 0 ]; then echo "cluster-test: skipped: needs root (network namespaces)"; exit 0; fi; \
	for t in tests/check_cluster.sh tests/check_cluster_mpi.sh tests/check_slurm.sh; do \
		s=0; $$t $(BUILD) || s=$$?; [ $$s -eq 0 ] || [ $$s -eq 77 ] || exit 1; \
	done

.PHONY: build-asan-tests
build-asan-tests: $(TESTS) $(OMP_EXAMPLES) $(TOOLS)

bench: deps $(BENCHES) $(BUILD)/bench_allreduce
	@for b in $(BENCHES); do OPENBLAS_NUM_THREADS=1 $$b || exit 1; done
	@OPENBLAS_NUM_THREADS=1 bench/run_allreduce.sh $(BUILD)
	@OPENBLAS_NUM_THREADS=1 bench/cluster.sh $(BUILD)

# Gradient buckets averaged during backward against blocking steps and compute alone, on 2 and 4
# simulated hosts (root; about 8 minutes; docs/measurements.md: OVERLAP)
.PHONY: bench-overlap
bench-overlap: deps
	@bench/overlap.sh $(BUILD)

$(BUILD):
	@mkdir -p $(BUILD)

# make hosts: distopt inside FANN's and darknet's own training loops (examples/hosts).
include examples/hosts/hosts.mk

$(filter-out $(BUILD)/test_core_portable $(BUILD)/test_ring_portable $(BUILD)/test_compress_fused $(BUILD)/test_compress_clang $(BUILD)/test_powersgd_portable $(BUILD)/test_openmp $(BUILD)/test_overlap_nothreads,$(TESTS)): $(BUILD)/%: tests/%.c tests/dtest.h tests/conformance.h tests/worlds.h tests/groups.h tests/links.h $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

$(BUILD)/test_core_portable: tests/test_core.c tests/dtest.h tests/conformance.h tests/worlds.h $(HEADERS) | $(BUILD)
	$(CC) $(filter-out $(BLAS_CFLAGS),$(ALL_CFLAGS)) -DDOPT_NO_BLAS -DDOPT_NO_VECTOR_EXT -o $@ $< -lm -lpthread -lrt

$(BUILD)/test_ring_portable: tests/test_ring.c tests/dtest.h tests/worlds.h $(HEADERS) | $(BUILD)
	$(CC) $(filter-out $(BLAS_CFLAGS),$(ALL_CFLAGS)) -DDOPT_NO_BLAS -DDOPT_NO_VECTOR_EXT -DDOPT_NO_THREADS -o $@ $< -lm -lrt

$(BUILD)/test_overlap_nothreads: tests/test_overlap.c tests/dtest.h tests/worlds.h $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -DDOPT_NO_THREADS -o $@ $< $(LIBS)

$(BUILD)/test_compress_fused: tests/test_compress.c tests/dtest.h tests/worlds.h $(HEADERS) | $(BUILD)
	$(CC) $(subst -std=c11,-std=gnu11,$(ALL_CFLAGS)) -ffp-contract=fast -o $@ $< $(LIBS)

$(BUILD)/test_powersgd_portable: tests/test_powersgd.c tests/dtest.h tests/worlds.h $(HEADERS) | $(BUILD)
	$(CC) $(subst -std=c11,-std=gnu11,$(filter-out $(BLAS_CFLAGS),$(ALL_CFLAGS))) -DDOPT_NO_BLAS -DDOPT_NO_VECTOR_EXT \
		-ffp-contract=fast -o $@ $< -lm -lpthread -lrt

$(BUILD)/test_compress_clang: tests/test_compress.c tests/dtest.h tests/worlds.h $(HEADERS) | $(BUILD)
	clang $(ALL_CFLAGS) -o $@ $< $(LIBS)

$(BUILD)/test_openmp: tests/test_openmp.c tests/dtest.h $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -fopenmp -o $@ $< $(LIBS)
$(BUILD)/test_%_ofast: tests/test_%.c tests/dtest.h tests/worlds.h tests/nonfinite.h $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -Ofast -o $@ $< $(LIBS)

$(BUILD)/test_%_clang_fastmath: tests/test_%.c tests/dtest.h tests/worlds.h tests/nonfinite.h $(HEADERS) | $(BUILD)
	clang $(ALL_CFLAGS) -ffast-math -o $@ $< $(LIBS)

$(MPI_TESTS): $(BUILD)/%: tests/%.c tests/dtest.h tests/conformance.h tests/worlds.h tests/groups.h tests/links.h tests/nonfinite.h $(HEADERS) | $(BUILD)
	$(MPICC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

# The examples include "distopt.h" as a user's program would, from the top directory; built with
# mpicc, they offer --transport mpi too.
$(EXAMPLES): $(BUILD)/%: examples/%.c examples/common.h examples/fashion_mnist.h $(HEADERS) | $(BUILD)
	$(MPICC) $(ALL_CFLAGS) -I. -o $@ $< $(LIBS) -lz

# The GPT-2 stand-in needs nothing but the headers and OpenMP (tests/check_gpt2_standin.sh).
$(OMP_EXAMPLES): $(BUILD)/%: examples/%.c $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -fopenmp -I. -o $@ $< $(LIBS)

# The host-aware allreduce across simulated hosts (tests/check_cluster.sh).
$(BUILD)/cluster_compress: bench/cluster_compress.c $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

$(BUILD)/cluster_allreduce: tests/cluster_allreduce.c tests/dtest.h tests/conformance.h $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

$(BUILD)/bench_allreduce: bench/bench_allreduce.c $(HEADERS) | $(BUILD)
	$(MPICC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

$(BUILD)/bench_%: bench/bench_%.c bench/bench_pair.h $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

# Which rank is everyone waiting for: reads the flight recorder's files (docs/reliability.md).
$(BUILD)/distopt-inspect: tools/distopt-inspect.c distopt.h | $(BUILD)
	$(CC) $(CSTD) $(WARN) $(OPT) $(DEFS) -I. -o $@ $<

# test_recorder runs distopt-inspect on the jobs it breaks.
$(BUILD)/test_recorder: $(BUILD)/distopt-inspect

# Compile checks: two translation units link; every header is valid C++; a host that does
# "#define inline" (kann under -std=c11) still compiles it without warnings.
$(BUILD)/check_two_units: tests/compile_check.c tests/compile_check_main.c $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -o $@ tests/compile_check_main.c tests/compile_check.c $(LIBS)

$(BUILD)/check_cxx: tests/compile_check.c tests/compile_check_main.c $(HEADERS) | $(BUILD)
	$(CXX) $(CXXSTD) $(WARN) $(OPT) $(DEFS) $(BLAS_CFLAGS) -x c++ -o $@ tests/compile_check_main.c tests/compile_check.c $(LIBS)

$(BUILD)/check_define_inline: tests/compile_check.c $(HEADERS) | $(BUILD)
	$(CC) $(ALL_CFLAGS) -DDOPT_CHECK_STATIC -o $@ tests/compile_check.c $(LIBS)

# libFuzzer targets (clang): each runs FUZZ_SECONDS from its committed corpus, which holds the
# inputs that once crashed it; a crash leaves its input in $(BUILD)/ and fails the target.
$(FUZZERS): $(BUILD)/fuzz_%: fuzz/fuzz_%.c $(HEADERS) | $(BUILD)
	clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -D_GNU_SOURCE -I. -o $@ $< -lm
$(BUILD)/fuzz_recorder: tools/distopt-inspect.c

fuzz: deps $(FUZZERS)
	@for f in $(FUZZERS); do n=$$(basename $$f); mkdir -p $(BUILD)/corpus/$$n; \
	  if $$f -max_len=4096 -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=$(BUILD)/ \
	      $(BUILD)/corpus/$$n fuzz/corpus/$${n#fuzz_} >$(BUILD)/$$n.log 2>&1; \
	  then echo "$$n: $$(grep -E '^Done' $(BUILD)/$$n.log)"; else tail -40 $(BUILD)/$$n.log; exit 1; fi; done

$(BUILD)/check_mpi_c: tests/compile_check_mpi.c $(HEADERS) | $(BUILD)
	$(MPICC) $(ALL_CFLAGS) -o $@ $< $(LIBS)

$(BUILD)/check_mpi_cxx: tests/compile_check_mpi.c $(HEADERS) | $(BUILD)
	mpicxx $(CXXSTD) $(WARN) $(OPT) $(DEFS) $(BLAS_CFLAGS) -x c++ -o $@ $< $(LIBS)

$(BUILD)/check_mpi_define_inline: tests/compile_check_mpi.c $(HEADERS) | $(BUILD)
	$(MPICC) $(ALL_CFLAGS) -DDOPT_CHECK_STATIC -o $@ $< $(LIBS)

install:
	install -d $(DESTDIR)$(PREFIX)/include/distopt $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 $(HEADERS) $(DESTDIR)$(PREFIX)/include/distopt/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@BLAS_CFLAGS@|$(BLAS_CFLAGS)|' -e 's|@BLAS_LIBS@|$(BLAS_LIBS)|' \
		distopt.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/distopt.pc

uninstall:
	rm -rf $(DESTDIR)$(PREFIX)/include/distopt
	rm -f $(DESTDIR)$(PREFIX)/lib/pkgconfig/distopt.pc

clean:
	rm -rf build build-asan
