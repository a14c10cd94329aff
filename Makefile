# Thin wrapper over CMake so the README's two commands stay two commands.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo

.PHONY: all deps build demo test bench clean

all: build

deps:
	bash .ci/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# The main job: a ring all-reduce written in the DSL, verified, and run through the NCCL API by 4
# ranks as processes, with nccl-tests' table and every result checked; then a small GPT trained on
# the Jargon File by 2 ranks (tensor + sequence parallel) on tutti's collectives, and a sample of
# what it learned.
demo: build
	$(BUILD)/bin/tutti-run -n 4 $(BUILD)/bin/tutti-demo
	$(BUILD)/bin/tutti-run -n 2 $(BUILD)/bin/tutti-train --tp 2 --sp --steps 100 --eval-every 25 --out runs/demo
	$(BUILD)/bin/tutti-train sample --checkpoint runs/demo/checkpoint_000100 --tokens 160 --temperature 0.6 --prompt "hacker: "

# The suite, then the sanitizer builds (ASan+UBSan, TSan) of its in-process programs and the fuzz
# smoke runs (.ci/sanitize.sh; SANITIZE=0 skips them).
SANITIZE ?= 1
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	if [ "$(SANITIZE)" != 0 ]; then JOBS=$(JOBS) bash .ci/sanitize.sh; fi

# Transport benchmark for docs/PERFORMANCE.md.
bench: build
	bash tools/bench/transport_report.sh $(BUILD)

clean:
	rm -rf $(BUILD)
