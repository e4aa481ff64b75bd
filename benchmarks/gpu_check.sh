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
#   6. the machine's CPU cores (the GPU hidden): tensor-parallel instances
#      (gloo) of a random-weight Llama-3.2-1B shape, 4 threads a rank (more ranks, more
#      cores); and `distserve bench engine` at 2 threads on SmolLM2-135M's
#      shape (random weights: the GGUF does not travel), with its bandwidth bound.
# Needs only torch and transformers besides this repo's own light dependencies (no model
# files): run it where $PYTHON (default python3) has a CUDA torch. Logs and the profile go
# to $OUT (else runs/gpu-check).
# Usage: bash benchmarks/gpu_check.sh [tests] [bench] [profile] [steps] [kv] [cpu]
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
  echo "== tp on the CPU, llama-3.2-1b shape, 4 threads a rank"
  timeout 200 "$py" benchmarks/tensor_parallel.py --model llama-3.2-1b --rank-threads 4 \
      --configs 1x1 2x1 4x1 --lengths 256 --batches 1 8 --context 128 --repeats 2 \
      --steps 4 --stream 0 --json "$out/tp_rank4.json" 2>&1 | grep -v Warning \
      | tee "$out/tp_rank4.txt"
  echo "== bench engine on the CPU, smollm2-135m-shape, 2 threads"
  timeout 200 bash -c "py=$py; $(declare -f distserve_cmd); distserve_cmd bench_engine engine \
      --model smollm2-135m-shape --device cpu --lengths 128 512 --batches 1 8 32 \
      --context 512 --threads 2" 2>&1 | tee "$out/bench_engine_cpu.txt" )
fi
