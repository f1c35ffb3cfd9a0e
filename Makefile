# The workbook's build. `make stage-N`, `make all`, `make test`, `make demo`, `make bench`.
# BACKEND=auto picks cuda when a GPU is visible (nvidia-smi lists one), else cpu.

BACKEND ?= auto
ifeq ($(BACKEND),auto)
  BACKEND := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifneq ($(filter-out cpu cuda,$(BACKEND)),)
  $(error BACKEND must be auto, cpu or cuda, not '$(BACKEND)')
endif

CC      := gcc
MPICC   ?= mpicc
NVCC    ?= nvcc
CUDA_HOME ?= /usr/local/cuda
# T4 (sm_75), A100 (sm_80), A10/RTX 30 (sm_86), L4/RTX 40 (sm_89), H100 (sm_90) as machine code,
# and sm_90's PTX, which the driver compiles for newer GPUs (Blackwell) when the program starts.
# `make test-cuda` and `make bench-cuda` build for the GPU present only (GPU_ARCHS, from
# nvidia-smi): one architecture compiles in a fifth of the time. CUDA_ARCHS=... overrides both.
CUDA_ARCHS ?= 75 80 86 89 90
CUDA_PTX ?= 90
GPU_ARCHS = $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d . | sort -u)
CFLAGS  ?= -O3 -march=native
# -fno-math-errno lets gcc vectorise sqrtf (AdamW is 8x faster); nothing reads errno from math
CFLAGS  += -std=c11 -Wall -Wextra -Werror -fopenmp -fno-math-errno -Icommon -MMD -MP
LDLIBS  := -lcjson -lm -fopenmp
NVFLAGS ?= -O3
NVFLAGS += -std=c++17 -Icommon $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
           $(foreach a,$(CUDA_PTX),-gencode arch=compute_$(a),code=compute_$(a)) \
           -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings -MMD -MP

B := build/$(BACKEND)
# one short line per file (`CC common/model/gpt.c`, `LD build/cpu/stage-3`), as kbuild prints;
# `make V=1` prints the whole commands
V ?= 0
ifeq ($(V),0)
  Q = @printf '  %-3s %s\n' $(1) $(2);
else
  Q =
endif
# ops_cuda.o depends on the architectures it was built for: a file holding them, rewritten only
# when they change, so that a build for the GPU present and a full one never mix their objects
ifeq ($(BACKEND),cuda)
  CUDA_ARCH_STAMP := $(B)/cuda-archs
  CUDA_ARCH_TEXT := sm $(CUDA_ARCHS) ptx $(CUDA_PTX)
  $(shell mkdir -p $(B) && (echo '$(CUDA_ARCH_TEXT)' | cmp -s - $(CUDA_ARCH_STAMP) || echo '$(CUDA_ARCH_TEXT)' >$(CUDA_ARCH_STAMP)))
  $(B)/common/ops/ops_cuda.o: $(CUDA_ARCH_STAMP)
endif
# common/ in folders by concern (common/README.md): base, ops, model, data, config, run, comm
COMMON := base/log base/files base/trace config/config data/tokenizer data/alpaca data/synthetic \
          model/gpt model/layout model/activations model/checkpoint run/run_setup run/optimizer run/muon run/loss_scale \
          run/metrics run/run_stats run/evaluate run/run_checkpoint run/preemption run/stage_run run/trainable run/lora
COMMON_OBJS := $(addprefix $(B)/common/,$(addsuffix .o,$(COMMON)))
ifeq ($(BACKEND),cuda)
  COMMON_OBJS += $(B)/common/ops/ops_cuda.o
  COMM_OBJS := $(B)/common/comm/comm.o $(B)/common/comm/comm_nccl.o $(B)/common/comm/comm_mpi.o $(B)/common/comm/flight.o
  # nvcc's kernel-launch stubs are C++ (guarded statics): gcc links them with libstdc++
  LDLIBS += -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -lcudart -lcublas -lcublasLt -lnccl -lstdc++
else
  # ops_cpu.c: the ops as a learner reads them; ops_cpu_fast.c: the paths that exist only for speed
  COMMON_OBJS += $(B)/common/ops/ops_cpu.o $(B)/common/ops/ops_cpu_fast.o
  # test_ops checks each fast path against its plain loop, on the CPU build only
  $(B)/tests/test_ops.o: CFLAGS += -DOPS_CPU_FAST_PATHS
  COMM_OBJS := $(B)/common/comm/comm.o $(B)/common/comm/comm_cpu.o $(B)/common/comm/comm_mpi.o $(B)/common/comm/flight.o
  LDLIBS += -ldnnl
endif
# what talks MPI is compiled and linked with mpicc
$(B)/common/comm/comm.o $(B)/common/comm/comm_mpi.o $(B)/common/comm/comm_cpu.o: CC := $(MPICC)
$(B)/common/comm/comm_nccl.o: CC := $(MPICC)
$(B)/common/comm/comm_nccl.o: CFLAGS += -I$(CUDA_HOME)/include

STAGE_DIR_1 := 01_single_gpu
STAGE_DIR_2 := 02_mixed_precision
STAGE_DIR_3 := 03_ddp
STAGE_DIR_4 := 04_fsdp
STAGE_DIR_5 := 05_tensor_parallel
STAGE_DIR_6 := 06_inference
STAGE_DIR_7 := 07_pipeline_parallel
STAGE_DIR_8 := 08_mixture_of_experts
STAGE_DIR_9 := 09_context_parallel
STAGE_DIR_10 := 10_composed
# the stages whose directory holds C files; from 03 on they talk MPI
STAGES := $(foreach n,1 2 3 4 5 6 7 8 9 10,$(if $(wildcard $(STAGE_DIR_$(n))/*.c),$(n)))
MPI_STAGES := $(filter 3 4 5 6 7 8 9 10,$(STAGES))
# files of another stage that a stage builds on: stage 06 on a grid wraps stage 05's tensor-parallel
# layers, and generates from stage 08's checkpoints with its mixture-of-experts MLP (08's moe.c)
STAGE_EXTRA_6 := 05_tensor_parallel/tp_linear.c 05_tensor_parallel/tp_model.c 08_mixture_of_experts/moe.c
# (and tp_model.c hands its sequence-parallel collectives to tp_sequence.c)
STAGE_EXTRA_6 += 05_tensor_parallel/tp_sequence.c
$(patsubst %.c,$(B)/%.o,$(STAGE_EXTRA_6)): CC := $(MPICC)
# ... and serves: the engine and its HTTP server in a room of their own, serving/, over the lesson's
# KV-cached model (-I06_inference: serving/ includes the lesson's headers by name)
STAGE_OBJS_6 := $(patsubst %.c,$(B)/%.o,$(wildcard 06_inference/serving/*.c))
$(B)/06_inference/%.o: CFLAGS += -I08_mixture_of_experts -I06_inference
# ... and its server runs its HTTP on threads of its own
STAGE_LIBS_6 := -pthread
# stage 10 composes the pieces: 07's pipeline (with its schedules) whose stages run 05's
# tensor-parallel layers (with their sequence-parallel collectives)
STAGE_EXTRA_10 := 05_tensor_parallel/tp_linear.c 05_tensor_parallel/tp_model.c 05_tensor_parallel/tp_sequence.c \
                  07_pipeline_parallel/pipeline.c 07_pipeline_parallel/schedules.c 07_pipeline_parallel/zero_bubble.c
# ... and its cp dimension runs 09's context parallelism inside those stages: its chunks, positions
# and ring attention (context.c, with 09's ring steps per backend below)
STAGE_EXTRA_10 += 09_context_parallel/context.c
# ... and its LoRA adapters are 05's slices of each stage's blocks (tp_lora.c)
STAGE_EXTRA_10 += 05_tensor_parallel/tp_lora.c
# ... and a mixture of experts runs 08's MoE MLP (moe.c) and its expert-parallel exchange (experts.c)
STAGE_EXTRA_10 += 08_mixture_of_experts/moe.c 08_mixture_of_experts/experts.c
$(patsubst %.c,$(B)/%.o,$(STAGE_EXTRA_10)): CC := $(MPICC)
# a stage's objects built per backend: stage 09's ring attention steps (kernels, or OpenMP loops)
STAGE_OBJS_9 := $(B)/09_context_parallel/backend/ring_blocks_$(BACKEND).o
# ... on the mesh of composed runs (common/comm/mesh.c)
STAGE_OBJS_10 := $(B)/common/comm/mesh.o $(STAGE_OBJS_9)

.PHONY: preflight exercise grade exercises-pack plot report all setup test test-programs test-mutations test-slurm test-multinode test-cuda bench bench-cuda demo clean $(addprefix stage-,$(STAGES))
all: $(addprefix stage-,$(STAGES)) tools

# scripts/setup.sh installs missing packages (apt) and only checks when none is missing; the
# stamp runs it once per build tree (again when the script changes). Objects need the packages
# first but not rebuilding when the stamp is renewed: an order-only prerequisite.
SETUP_STAMP := build/.setup-ok
setup: $(SETUP_STAMP)
$(SETUP_STAMP): scripts/setup.sh
	@bash scripts/setup.sh
	@mkdir -p $(dir $@) && touch $@

$(B)/%.o: %.c | $(SETUP_STAMP)
	@mkdir -p $(dir $@)
	$(call Q,CC,$<)$(CC) $(CFLAGS) -c $< -o $@
$(B)/%.o: %.cu | $(SETUP_STAMP)
	@mkdir -p $(dir $@)
	$(call Q,NVCC,$<)$(NVCC) $(NVFLAGS) -c $< -o $@

# build/stage-N is a copy of the binary of the backend built last (always refreshed, so that
# `make BACKEND=cpu` after a CUDA build puts the CPU one back); build/<backend>/ keeps both. The copy
# is renamed into place: a running server keeps its file, where cp onto it fails ("Text file busy").
# Stages from 03 on talk MPI: compiled and linked with mpicc, with the comm layer.
define stage_rule
stage-$(1): build/stage-$(1)
build/stage-$(1): $(B)/stage-$(1)
	@cp $$< $$@.tmp && mv -f $$@.tmp $$@
$(B)/stage-$(1): $(patsubst %.c,$(B)/%.o,$(wildcard $(STAGE_DIR_$(1))/*.c) $(STAGE_EXTRA_$(1))) $(STAGE_OBJS_$(1)) $(COMMON_OBJS) $(if $(filter $(1),$(MPI_STAGES)),$(COMM_OBJS))
	$$(call Q,LD,$$@)$(if $(filter $(1),$(MPI_STAGES)),$(MPICC),$(CC)) $$^ -o $$@ $(LDLIBS) $(STAGE_LIBS_$(1))
$(if $(filter $(1),$(MPI_STAGES)),$(B)/$(STAGE_DIR_$(1))/%.o: CC := $(MPICC))
endef
$(foreach n,$(STAGES),$(eval $(call stage_rule,$(n))))

TOOLS := tokenize peak_flops ceilings plan lora_merge
tools: $(addprefix build/,$(TOOLS))
build/tokenize: $(B)/tokenize
	@cp $< $@
$(B)/tokenize: $(B)/tools/tokenize.o $(COMMON_OBJS)
	$(call Q,LD,$@)$(CC) $^ -o $@ $(LDLIBS)
build/lora_merge: $(B)/lora_merge
	@cp $< $@
$(B)/lora_merge: $(B)/tools/lora_merge.o $(COMMON_OBJS)
	$(call Q,LD,$@)$(CC) $^ -o $@ $(LDLIBS)
build/peak_flops: $(B)/peak_flops
	@cp $< $@
$(B)/peak_flops: $(B)/tools/peak_flops.o $(COMMON_OBJS)
	$(call Q,LD,$@)$(CC) $^ -o $@ $(LDLIBS)
build/ceilings: $(B)/ceilings
	@cp $< $@
$(B)/ceilings: $(B)/tools/ceilings.o $(COMMON_OBJS)
	$(call Q,LD,$@)$(CC) $^ -o $@ $(LDLIBS)
# the planner sizes layouts with the stages' own arithmetic (fsdp.c, tp_model.c, kv_cache.c, pipeline.c,
# experts.c, moe.c and context.c): it links them, and with them the comm layer (mpicc), which its ping-pong calibration uses too
PLAN_TOOL_OBJS := $(addprefix $(B)/tools/,plan.o plan_cluster.o plan_measure.o plan_serve.o)
PLAN_OBJS := $(PLAN_TOOL_OBJS) \
             $(addprefix $(B)/,04_fsdp/fsdp.o 05_tensor_parallel/tp_linear.o 05_tensor_parallel/tp_model.o \
                               06_inference/kv_cache.o \
                               07_pipeline_parallel/pipeline.o 08_mixture_of_experts/experts.o 08_mixture_of_experts/moe.o \
                               09_context_parallel/context.o) $(STAGE_OBJS_9) \
             $(addprefix $(B)/07_pipeline_parallel/,schedules.o zero_bubble.o)
PLAN_OBJS += $(B)/05_tensor_parallel/tp_sequence.o
$(PLAN_TOOL_OBJS): CC := $(MPICC)
$(PLAN_TOOL_OBJS): CFLAGS += -I04_fsdp -I05_tensor_parallel -I06_inference -I07_pipeline_parallel -I08_mixture_of_experts -I09_context_parallel
build/plan: $(B)/plan
	@cp $< $@
$(B)/plan: $(PLAN_OBJS) $(COMMON_OBJS) $(COMM_OBJS)
	$(call Q,LD,$@)$(MPICC) $^ -o $@ $(LDLIBS)
.PHONY: tools $(addprefix build/stage-,$(STAGES)) $(addprefix build/,$(TOOLS))
# the preflight's communication check (tools/preflight_comm.c): an MPI program on the comm layer
build/preflight_comm: $(B)/preflight_comm
	@cp $< $@
$(B)/preflight_comm: $(B)/tools/preflight_comm.o $(COMMON_OBJS) $(COMM_OBJS)
	$(call Q,LD,$@)$(MPICC) $^ -o $@ $(LDLIBS)
$(B)/tools/preflight_comm.o: CC := $(MPICC)
tools: build/preflight_comm
.PHONY: build/preflight_comm

# ---- tests: every tests/test_*.c is a program, every tests/test_*.sh a script; run.sh runs all.
# tests/mpi/*.c are MPI programs that the scripts start with mpirun.
TEST_PROGS := $(patsubst tests/%.c,build/tests/%,$(wildcard tests/test_*.c)) \
              $(patsubst tests/mpi/%.c,build/tests/mpi/%,$(wildcard tests/mpi/*.c))
# tests/test_llama_tokenizer.sh's program (run.sh runs build/tests/test_* only, so not on its own)
TEST_PROGS += build/tests/tokenizer_ids
# tests/test_fp8.sh's program
TEST_PROGS += build/tests/fp8_codes
# the speed exercises' check (exercises/catalogue.json): a timing, so never a test of its own
TEST_PROGS += build/tests/speed_bound
build/tests/mpi/%: $(B)/tests/mpi/%.o $(COMMON_OBJS) $(COMM_OBJS)
	@mkdir -p $(dir $@)
	$(call Q,LD,$@)$(MPICC) $^ -o $@ $(LDLIBS)
$(B)/tests/mpi/%.o: CC := $(MPICC)
# a check of a stage's code links that stage's objects: one prerequisite line per program
build/tests/mpi/tp_linear_check: $(B)/05_tensor_parallel/tp_linear.o
# the mesh of composed runs (common/comm/mesh.c), which stage 10 links
build/tests/mpi/mesh_check: $(B)/common/comm/mesh.o
build/tests/mpi/ring_allreduce_check: $(B)/03_ddp/ring_allreduce.o
$(B)/tests/mpi/ring_allreduce_check.o: CFLAGS += -I03_ddp
build/tests/test_moe build/tests/test_gpt: $(B)/08_mixture_of_experts/moe.o
$(B)/tests/test_moe.o $(B)/tests/test_gpt.o: CFLAGS += -I08_mixture_of_experts
build/tests/test_sampler build/tests/test_top_p: $(B)/06_inference/sampler.o
build/tests/test_prefix_cache: $(B)/06_inference/serving/block_pool.o $(B)/06_inference/serving/prefix_cache.o
build/tests/test_request_logits: $(B)/06_inference/sampler.o $(B)/06_inference/serving/request_logits.o
build/tests/test_chat_template: $(B)/06_inference/serving/chat_template.o $(B)/06_inference/serving/buf.o
$(B)/tests/test_sampler.o $(B)/tests/test_top_p.o: CFLAGS += -I06_inference
$(B)/tests/test_prefix_cache.o $(B)/tests/test_request_logits.o $(B)/tests/test_chat_template.o: CFLAGS += -I06_inference -I06_inference/serving -I08_mixture_of_experts
build/tests/%: $(B)/tests/%.o $(COMMON_OBJS)
	@mkdir -p $(dir $@)
	$(call Q,LD,$@)$(CC) $^ -o $@ $(LDLIBS)

# test_ops is the one test program built for CUDA too: the ops against their double-precision reference
build/cuda/tests/test_ops: build/cuda/tests/test_ops.o $(COMMON_OBJS)
	$(call Q,LD,$@)$(CC) $^ -o $@ $(LDLIBS)
# `make test-cuda`: tests/cuda_run.sh builds every CUDA binary into build/cuda/ for the GPU present
# (not `all`: build/stage-N stay the CPU copies the other tests run) and runs the CUDA tests
# section by section within a time budget (TEST_CUDA_BUDGET, seconds, default 600 including the
# build): test_ops on the GPU, stage 01 against the CPU's loss curve, CUDA graphs, every stage's
# equivalence tests on 1 GPU and on 2-4 ranks (sharing it, or one a GPU over NCCL where there are
# enough), compute-sanitizer's memcheck. A section that would not finish within the budget is
# reported as not run, never as passed. It writes build/cuda/test-cuda.json and ends with "N
# passed, N failed". Without nvcc or without a GPU it still exits 0, and says SKIPPED.
CUDA_BINS := $(addprefix build/cuda/,$(addprefix stage-,$(STAGES)) $(TOOLS) tests/test_ops)
test-cuda:
	@CUDA_BINS="$(CUDA_BINS)" $(if $(filter command line environment,$(origin CUDA_ARCHS)),,$(if $(GPU_ARCHS),CUDA_ARCHS="$(GPU_ARCHS)" CUDA_PTX=)) \
		bash tests/cuda_run.sh

# `make bench-cuda`: stage 01 and 02 at GPT-2 124M, tokens/s and MFU against the GPU's peak, and
# stage 06's decode at batch 1 and 8 against the GPU's memory bandwidth (scripts/bench_cuda.sh);
# SKIPPED, exit 0, without a GPU
bench-cuda:
	@$(if $(filter command line environment,$(origin CUDA_ARCHS)),,$(if $(GPU_ARCHS),CUDA_ARCHS="$(GPU_ARCHS)" CUDA_PTX=)) \
		bash scripts/bench_cuda.sh

test:
	@$(MAKE) --no-print-directory BACKEND=cpu all $(TEST_PROGS)
	@bash tests/run.sh

# what the tests run: every stage and tool and every test program (tests/mutations.py rebuilds it
# after planting each bug, so that a script's programs carry the bug too)
test-programs: all $(TEST_PROGS)

# plants each bug listed in tests/mutations.txt, one at a time, in a scratch copy of the tree,
# rebuilds it and runs the tests named beside the bug (tests/mutations.py); not part of `make test`
test-mutations:
	@$(MAKE) --no-print-directory BACKEND=cpu all $(TEST_PROGS)
	@python3 tests/mutations.py

# a real Slurm on localhost: submits every stage's sbatch script (tests/slurm/run.sh)
test-slurm:
	@$(MAKE) --no-print-directory BACKEND=cpu all
	@bash tests/slurm/run.sh

# several hosts on one machine (network namespaces, a real Slurm): stages 3-5, 7 and 9 across 2 hosts
test-multinode:
	@$(MAKE) --no-print-directory BACKEND=cpu all
	@bash tests/multinode/run.sh

# `make preflight`: is this machine ready for a session? Toolchain, libraries, GPUs, MPI, bus
# bandwidth, disk, model files, a step of every stage: a table, and build/preflight/preflight.json
# (tools/preflight.py; its options through PREFLIGHT_ARGS="--configs ... --expect_busbw=...").
preflight:
	@$(MAKE) --no-print-directory all build/preflight_comm
	@OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
		python3 tools/preflight.py --backend=$(BACKEND) $(PREFLIGHT_ARGS)

bench:
	@$(MAKE) --no-print-directory all
	@bash scripts/bench.sh
# parts of `make bench` alone: a step against its bound on this machine (scripts/bench_bound.sh),
# and stage 01 with another process on one core against idle (scripts/bench_sharing.sh); both add
# their figures to build/bench/bench.json
.PHONY: bench-bound bench-sharing
bench-bound:
	@$(MAKE) --no-print-directory BACKEND=cpu all
	@bash scripts/bench_bound.sh
bench-sharing:
	@$(MAKE) --no-print-directory BACKEND=cpu all
	@bash scripts/bench_sharing.sh

demo:
	@$(MAKE) --no-print-directory BACKEND=cpu all
	@bash scripts/demo.sh

# gnuplot plots of any runs overlaid, and the static report page about them (tools/report.py)
plot:
	@bash scripts/plot.sh $(if $(PLOTS),-o $(PLOTS)) $(RUNS)
report:
	@python3 tools/report.py $(if $(REPORT),-o $(REPORT)) $(RUNS)

# exercises (exercises/README.md): a learner's copy of the workbook in work/<EX>/ with one body to
# write, graded by the stages' own tests; the copy reuses this tree's build, so build it first
exercise:
	@test -n "$(EX)" || { echo "make exercise EX=<id>; the exercises: python3 tools/exercise.py list"; exit 2; }
	@$(MAKE) --no-print-directory BACKEND=cpu all $(TEST_PROGS)
	@python3 tools/exercise.py start $(EX) $(if $(AGAIN),--again)
grade:
	@python3 tools/exercise.py grade $(EX)
exercises-pack:
	@python3 tools/exercise.py pack

clean:
	rm -rf build

# keep object files between runs (make would delete them as intermediates)
.SECONDARY:

-include $(shell find build -name '*.d' 2>/dev/null)
