#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine that has Python 3.12 and torch 2.11.0 (CUDA 13.0) but
# no network and no klrl stack (docs/gpu.md, "The GPU check on a lent machine"): the packages
# it lacks, built here into one payload, and the one command that runs the check there.
#
#   bash cluster/bench/gpu_payload.sh build            # here: writes .gpu/ (git-ignored)
#   bash cluster/bench/gpu_payload.sh chunks           # here: cuts it again (seconds)
#   bash cluster/bench/gpu_payload.sh check [BUDGET_S] # there, from the repository root
#
# build: the wheels the machine lacks (vllm 0.26.0, the gpu extra's pin and the newest vLLM
# that pins the machine's torch; Ray and DeepSpeed at the project's floors; what vLLM's offline
# engine and klrl import there), installed into one site-packages for CPython 3.12, stripped of
# what klrl's offline dense-model path on a Hopper GPU never loads (STRIP), packed reproducibly
# (sorted names, fixed times and owners: a rebuild gives the same bytes, so chunks of two
# builds never mix unnoticed), compressed with xz -9e, and cut into chunks that each fit one
# call beside the working tree (a call carries at most 64 MiB). It also copies the demo model,
# which the check's outside-engine part would otherwise build there (about two minutes).
# It prints the sizes and the device calls, in order. chunks does that last part alone: run it
# when the working tree has grown since the build (the chunks must leave room for it).
#
# check: copies the chunk this call carries next to those earlier calls left in /root/up,
# checks the whole against the build's sha256, unpacks it into /tmp/site once per machine,
# and runs `python3 -m cluster.bench.gpu_check` with the budget (default 480 s), writing
# gpu-check.json and gpu-check.log into $OUT after every part. A gpu-check.json from an earlier
# window put at .gpu/check/gpu-check.json is carried on from (the check goes on where it
# stopped).
#
# Knobs: PY (the Python that builds DeepSpeed's wheel; default .venv/bin/python),
# CALL_BYTES (what one call may carry; default 64 MiB); for check, PYTHON (default python3),
# SITE (where the payload is unpacked; default /tmp/site) and CHUNKS (where the chunks of
# earlier calls wait; default /root/up). GPU_DIR: the payload's folder (default .gpu).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
G=${GPU_DIR:-.gpu}

WHEELS="vllm==0.26.0 ray==2.60.0
  pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  cachetools==8.0.1 cbor2==6.3.0 msgspec==0.22.0 pyzmq==27.3.0 pybase64==1.5.1
  openai==3.54.0 openai-harmony==0.0.8 httpx2==2.16.2 sniffio==1.3.1
  llguidance==1.7.6 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  hjson==3.1.0 omegaconf==2.4.0"
# vllm's metadata asks for apache-tvm-ffi 0.1.10, with which xgrammar 0.2.8 does not import;
# 0.1.15.post2 ran on the H100. DeepSpeed 0.19.8 is an sdist: built into a pure wheel here.
DEEPSPEED=deepspeed==0.19.8

# Not loaded by the offline engine on a dense model on sm90, nor by klrl:
# - vllm: FlashAttention 2 (sm80; FA3 is what vLLM picks on Hopper), the MoE, FlashMLA and
#   QuTLASS (FP4) kernels (optional imports: vllm/platforms/cuda.py), DeepGEMM and the sm100
#   FMHA sources, the Rust serving front end and tool parser, the server's static files;
# - ray: the Java jars, the dashboard's web client, and the libraries klrl never imports
#   (rllib, tune, train, serve, data, llm);
# - every package's console scripts (bin/: their shebangs name this machine's Python);
# - DeepSpeed's record of the ops built here (none: it detects them there; __version__ then
#   reads 0.0.0).
STRIP="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so
  vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/_qutlass_C.abi3.so
  vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 vllm/vllm-rs
  vllm/_rust_tool_parser.abi3.so vllm/entrypoints/serve/instrumentator/static
  ray/jars ray/dashboard/client/build ray/rllib ray/tune ray/train ray/serve ray/data ray/llm
  bin deepspeed/git_version_info_installed.py"

PLATFORMS=""
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
         manylinux_2_34 manylinux_2_35 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done

say() { printf '[gpu_payload %4ds] %s\n' "$SECONDS" "$*"; }

build() {
  local py=${PY:-.venv/bin/python} call_bytes=${CALL_BYTES:-67108864}
  [ -x "$py" ] || { echo "no $py: run 'make venv' first, or set PY" >&2; exit 1; }
  mkdir -p $G/dl $G/check
  say "wheels into $G/dl (kept between builds)"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d $G/dl $WHEELS
  ls $G/dl/deepspeed-0.19.8-*.whl > /dev/null 2>&1 ||
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w $G/dl "$DEEPSPEED"
  local files=()
  for spec in $WHEELS $DEEPSPEED; do
    local name=${spec%%==*} version=${spec#*==} hits
    hits=$(ls $G/dl | grep -iE "^${name//[-_.]/[-_.]}-${version}-" || true)
    [ "$(echo "$hits" | grep -c .)" = 1 ] || { echo "$spec: not exactly one wheel in $G/dl: $hits" >&2; exit 1; }
    files+=("$G/dl/$hits")
  done
  say "installing ${#files[@]} wheels into $G/site (no dependencies: the list above is all)"
  rm -rf $G/site && mkdir -p $G/site
  # shellcheck disable=SC2086
  "$py" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS --target $G/site "${files[@]}"
  ( cd $G/site
    for p in $STRIP; do
      [ -e "$p" ] || echo "note: $p is not in the wheels (their layout changed?)"
      rm -rf "$p"
    done
    find . -name __pycache__ -prune -exec rm -rf {} + )
  say "site-packages: $(du -sm $G/site | cut -f1) MB; xz -9e (minutes on two cores)"
  tar -C $G/site --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . |
    xz -9e -T0 > $G/payload.tar.xz.tmp
  mv $G/payload.tar.xz.tmp $G/payload.tar.xz
  (cd $G && sha256sum payload.tar.xz) > $G/check/payload.sha256
  chunks
}

chunks() {
  local py=${PY:-.venv/bin/python} call_bytes=${CALL_BYTES:-67108864}
  [ -f $G/payload.tar.xz ] || { echo "no $G/payload.tar.xz: run build first" >&2; exit 1; }
  # The demo model, from klrl's cache (built there if missing).
  local model
  model=$("$py" -c "from cluster.tiny.model import init_default_model; print(init_default_model())")
  rm -rf $G/check/klrl_home && mkdir -p $G/check/klrl_home/models
  cp -r "$model" $G/check/klrl_home/models/

  # Chunks: each call carries the working tree (tracked and untracked, not ignored) besides.
  local tree check payload room chunk n=0
  tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
         awk '{s += $1} END {print s + 0}')
  check=$(du -sb $G/check | cut -f1)
  payload=$(stat -c %s $G/payload.tar.xz)
  room=$(( call_bytes - tree - check - 1048576 ))  # 1 MiB spare
  [ "$room" -gt 8000000 ] || { echo "the working tree ($tree bytes) leaves no room for the payload" >&2; exit 1; }
  rm -rf $G/up* && split -b "$room" -d -a 2 $G/payload.tar.xz $G/part.
  : > $G/check/parts.txt
  for p in $G/part.*; do
    n=$((n + 1)); mkdir -p $G/up$n; mv "$p" $G/up$n/; basename "$p" >> $G/check/parts.txt
  done
  say "payload $payload bytes (sha256 $(cut -c1-12 $G/check/payload.sha256)...) in $n chunk(s); working tree $tree bytes, .gpu/check $check bytes"
  echo
  echo "Device calls, back to back (a machine idle for 30 s goes back with what it was sent):"
  local i
  for i in $(seq 1 $((n - 1))); do
    echo " $i. run(carry=[\".gpu/up$i\"], timeout_s=120, command=\"mkdir -p /root/up && cp .gpu/up$i/part.* /root/up/\")"
  done
  echo " $n. run(carry=[\".gpu/up$n\", \".gpu/check\"], timeout_s=600, command=\"bash cluster/bench/gpu_payload.sh check 480\")"
  echo " $((n + 1)). give_back()"
  echo "gpu-check.json and gpu-check.log come back under the last call's files_at; put the JSON"
  echo "at .gpu/check/gpu-check.json to go on in a later window."
}

check() {
  local budget=${1:-480} out=${OUT:-$ROOT/gpu-check-out} want got p parts=()
  local site=${SITE:-/tmp/site} chunks=${CHUNKS:-/root/up}
  mkdir -p "$chunks" "$out"
  for p in $G/up*/part.*; do [ -f "$p" ] && cp -f "$p" "$chunks/"; done
  want=$(cut -d' ' -f1 $G/check/payload.sha256)
  if [ "$(cat "$site/.payload" 2>/dev/null)" != "$want" ]; then
    for p in $(cat $G/check/parts.txt); do
      [ -f "$chunks/$p" ] || { echo "chunk $p is missing: this is a fresh machine; make every chunk's call again, back to back" >&2; exit 3; }
      parts+=("$chunks/$p")
    done
    got=$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "the chunks' sha256 is $got, the build's $want: chunks of two builds" >&2; exit 3; }
    rm -rf "$site" && mkdir -p "$site"
    cat "${parts[@]}" | xz -d -T0 | tar -x -C "$site"
    echo "$want" > "$site/.payload"
    say "payload unpacked into $site ($(du -sm "$site" | cut -f1) MB)"
  fi
  export PYTHONPATH=$site KLRL_HOME=${KLRL_HOME:-/tmp/klrl_home}
  [ -d "$KLRL_HOME/models" ] || { mkdir -p "$KLRL_HOME" && cp -r $G/check/klrl_home/. "$KLRL_HOME/"; }
  # vLLM 0.26's GPU sampler imports FlashInfer unless told not to; it is not carried.
  export VLLM_USE_FLASHINFER_SAMPLER=0 WANDB_MODE=disabled HF_HUB_OFFLINE=1
  export TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  [ -f $G/check/gpu-check.json ] && [ ! -f "$out/gpu-check.json" ] &&
    cp $G/check/gpu-check.json "$out/gpu-check.json"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "${PYTHON:-python3}" -m cluster.bench.gpu_check --budget-s "$budget" \
    --json "$out/gpu-check.json" --log "$out/gpu-check.log"
}

case "${1:-}" in
  build) build ;;
  chunks) chunks ;;
  check) shift; check "$@" ;;
  *) echo "usage: $0 build | chunks | check [BUDGET_S]" >&2; exit 2 ;;
esac
