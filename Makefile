# Every target does its own set-up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench gpu-check clean

$(STAMP): pyproject.toml
	@scripts/setup_system.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,demo,bench]'
	# torchtitan's own Llama 3 and CheckpointManager for the torch-native tests (docs/titan.md):
	# without --no-deps it would pull wandb and datasets and downgrade fsspec
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3
	$(PY) -m pip install -q tyro==1.0.17 torchdata==0.11.0 tensorboard==2.21.0
	@touch $(STAMP)

setup: $(STAMP)

# two pytest workers (pytest-xdist), each test file on one of them: the multi-process tests spend much of
# their time waiting (start-up, failure detection), so two overlap on 2 cores (docs/benchmarks.md, "The suite's time")
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) scripts/bench_reshard.py
	$(PY) scripts/bench_vs_dcp.py
	$(PY) scripts/bench_byo.py --json docs/bench/bench_byo.json   # drops the page cache before cold loads when run as root
	PYTHONPATH=. $(PY) scripts/bench_migrate.py --json
	$(PY) scripts/bench_remote.py --json   # needs moto[server] and s3fs (the test extras)
	$(PY) scripts/bench_recovery.py
	PYTHONPATH=. $(PY) scripts/bench_recovery.py --join   # in-process scale up: 2 workers admit 2 joiners (docs/bench/bench_join.json)
	PYTHONPATH=. $(PY) scripts/bench_recovery.py --json   # in-process vs restart on the same job, tiny and llama-100m; the native 12.1M Llama beside torchft 0.2.0: kill -> next step, and back at full size with a replacement vs its heal (the replacement's timeline), and with a spare promoted at the failure; the rank-0 kill again with the membership on a 3-member etcd cluster, its host's member (the leader) killed too; torchtitan's trainer, 1 of 4 killed, in process vs its own restart (docs/bench/bench_inprocess.json, titan_elastic.json)
	PYTHONPATH=. $(PY) scripts/bench_etcd.py --json   # the membership store's etcd: its leader killed -> the next write, at the cluster's raft timings and two slower ones (docs/bench/bench_etcd.json)
	PYTHONPATH=. $(PY) scripts/bench_native_inprocess.py --repeats 3   # the torch-native job's in-process recovery (docs/bench/bench_native_inprocess.json)
	PYTHONPATH=. $(PY) scripts/bench_locality.py --repeats 5   # the survivors' locality order for torch-native state dicts, 8-512 ranks (docs/bench/bench_locality.json)
	$(PY) scripts/bench_schedule.py
	$(PY) scripts/bench_schedule_scale.py --json   # the scheduler at 1,024-16,384 GPUs
	$(PY) scripts/bench_scale.py --json   # chooser, assignment, plans, world sizes, tenplex simulate (#20)
	PYTHONPATH=. $(PY) scripts/calibrate_simulate.py --json --beyond   # the failure simulator against published runs, 405B beyond them (#33; docs/bench/calibrate_simulate.json)
	$(PY) scripts/bench_vfs.py --out docs/bench/bench_vfs
	PYTHONPATH=. $(PY) scripts/bench_data.py --json   # users' formats through tenplex vs a plain DataLoader, goal ratio >= 0.95 (docs/bench/bench_data.json)
	$(PY) -m tenplex bench bubbles --plot docs/bench/bubbles_timeline.png
	$(PY) scripts/bench_bubbles_cuda.py --json docs/bench/bench_bubbles_cuda.json   # needs a GPU; says so and skips without
	$(PY) scripts/measure_memory.py
	$(PY) scripts/measure_memory.py --gpu   # needs a GPU; says so and skips without

# one GPU, under 8 minutes: the CUDA tests, in-place CUDA loads, bubbles, memory, live move (docs/gpu/README.md)
gpu-check: $(STAMP)
	PYTHONPATH=. $(PY) scripts/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
