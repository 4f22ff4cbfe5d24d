#!/usr/bin/env bash
# The GPU smoke run (`make gpu-smoke`, cluster/bench/gpu_smoke.py) and `make gpu-check` on a lent
# GPU machine that has Python 3.12 and torch 2.11.0 (CUDA 13.0) but no network and no klrl
# stack (docs/gpu.md, "On a lent machine"): the packages it lacks, built here into one payload,
# and the commands that install it and run there.
#
#   bash cluster/bench/gpu_payload.sh build            # here: writes .gpu/ (git-ignored)
#   bash cluster/bench/gpu_payload.sh chunks           # here: cuts it again for today's tree
#   bash cluster/bench/gpu_payload.sh calls            # here: the device calls, and how many
#   bash cluster/bench/gpu_payload.sh stash            # there: keep this call's chunk
#   bash cluster/bench/gpu_payload.sh unpack           # there: install the payload (once)
#   bash cluster/bench/gpu_payload.sh smoke [WINDOW] [DEADLINE_S]  # there: unpack, then the run
#   bash cluster/bench/gpu_payload.sh check [BUDGET_S] # there: unpack, then make gpu-check
#
# build: the wheels the machine lacks (vllm 0.26.0, the gpu extra's pin and the newest vLLM
# that pins the machine's torch; Ray and DeepSpeed at the project's floors; what vLLM's offline
# engine and klrl import there), installed into one site-packages for CPython 3.12, stripped of
# what klrl's offline dense-model path on a Hopper GPU never loads (STRIP), packed reproducibly
# (sorted names, fixed times and owners: a rebuild gives the same bytes, so chunks of two
# builds never mix unnoticed), compressed with xz -9e, and cut into chunks that each fit one
# call beside the working tree (a call carries at most 64 MiB). It also copies the demo model,
# which the demo steps would otherwise build there (about two minutes), and the commit.
# chunks does that last part alone: run it when the working tree has changed size since the
# build (the chunks must leave room for it); calls prints the sequence again.
#
# unpack (the smoke run's first step): copies the chunk this call carries next to those earlier
# calls stashed in /root/up, checks the whole against the build's sha256, unpacks it into
# /tmp/site once per machine, installs it through a .pth file in the interpreter's
# site-packages (so that a process started with another PYTHONPATH, as Ray's workers and
# tests/test_own_model.py's runs are, still finds it; PYTHONPATH names it too, first, as on the
# H100 runs), byte-compiles it and the checkout (compileall on all cores: the first imports of
# every later process then read bytecode), and puts the demo model into KLRL_HOME. Without a
# payload it exits 77 (skipped) where the stack is missing, 0 where it is installed already.
#
# Knobs: PY (the Python that builds DeepSpeed's wheel; default .venv/bin/python),
# CALL_BYTES (what one call may carry; default 64 MiB), PAYLOAD_BYTES (calls without a built
# payload: its size; default the 2026-11-27 build's); for unpack/smoke/check: PYTHON (default
# python3), SITE (where the payload is unpacked; default /tmp/site), CHUNKS (where the chunks
# of earlier calls wait; default /root/up), PTH_DIR (where the .pth file goes; default the
# interpreter's first writable site-packages, else its user site). GPU_DIR: the payload's
# folder (default .gpu).
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

# What travels with every call: the working tree, tracked and untracked (not ignored) files.
tree_bytes() {
  git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
    awk '{s += $1} END {print s + 0}'
}

# How large a chunk may be for today's tree: ROOM_FIRST beside the tree alone (the stash
# calls), ROOM_LAST beside the tree and .gpu/check (the last call, which runs); 1 MiB spare.
rooms() {
  local call_bytes=${CALL_BYTES:-67108864}
  TREE=$(tree_bytes)
  CHECK=$(du -sb $G/check 2>/dev/null | cut -f1 || true); CHECK=${CHECK:-4000000}  # the model, about 4 MB
  ROOM_FIRST=$(( call_bytes - TREE - 1048576 )); ROOM_LAST=$(( ROOM_FIRST - CHECK ))
  [ "$ROOM_LAST" -gt 8000000 ] || { echo "the working tree ($TREE bytes) leaves no room for the payload" >&2; exit 1; }
}

# The fewest chunks of a payload of $1 bytes: all but the last of ROOM_FIRST bytes.
count_chunks() {
  local n=1
  while [ $(( (n - 1) * ROOM_FIRST + ROOM_LAST )) -lt "$1" ]; do n=$((n + 1)); done
  echo $n
}

chunks() {
  local py=${PY:-.venv/bin/python} model n=0
  [ -f $G/payload.tar.xz ] || { echo "no $G/payload.tar.xz: run build first" >&2; exit 1; }
  # The demo model, from klrl's cache (built there if missing), and the commit it was cut at.
  model=$("$py" -c "from cluster.tiny.model import init_default_model; print(init_default_model())")
  rm -rf $G/check/klrl_home && mkdir -p $G/check/klrl_home/models
  cp -r "$model" $G/check/klrl_home/models/
  git describe --always --dirty --abbrev=12 > $G/check/commit.txt 2>/dev/null || true
  rooms
  rm -rf $G/up* && split -b "$ROOM_FIRST" -d -a 2 $G/payload.tar.xz $G/part.
  : > $G/check/parts.txt
  for p in $G/part.*; do
    n=$((n + 1)); mkdir -p $G/up$n; mv "$p" $G/up$n/; basename "$p" >> $G/check/parts.txt
  done
  # the last chunk rides beside .gpu/check: one more call where it does not fit there
  [ "$(stat -c %s $G/up$n/part.*)" -le "$ROOM_LAST" ] || {
    echo "the last chunk does not fit beside $G/check: cut with CALL_BYTES smaller" >&2; exit 1; }
  say "payload $(stat -c %s $G/payload.tar.xz) bytes (sha256 $(cut -c1-12 $G/check/payload.sha256)...) in $n chunk(s); working tree $TREE bytes, $G/check $CHECK bytes"
  calls
}

# The device calls for today's tree: one per chunk (the last rides with the smoke run), then
# give_back.
calls() {
  local payload n i estimate=""
  rooms
  if [ -f $G/payload.tar.xz ]; then payload=$(stat -c %s $G/payload.tar.xz)
  else payload=${PAYLOAD_BYTES:-102800000}; estimate=" (not built here: the size of the 2026-11-27 build)"; fi
  n=$(count_chunks "$payload")
  [ -f $G/check/parts.txt ] && n=$(grep -c . $G/check/parts.txt)
  # the commit the smoke run's lines name: the tree as these calls will send it
  [ -d $G/check ] && { git describe --always --dirty --abbrev=12 > $G/check/commit.txt 2>/dev/null || true; }
  awk -v t="$TREE" -v p="$payload" -v n="$n" -v e="$estimate" 'BEGIN {
    printf "working tree %.1f MB, payload %.1f MB%s: %d chunk(s), %d run call(s) and give_back\n",
      t / 1e6, p / 1e6, e, n, n }'
  echo "Device calls, back to back (a machine idle for 30 s goes back with what it was sent):"
  for i in $(seq 1 $((n - 1))); do
    echo " $i. run(carry=[\".gpu/up$i\"], timeout_s=120, command=\"bash cluster/bench/gpu_payload.sh stash\")"
  done
  echo " $n. run(carry=[\".gpu/up$n\", \".gpu/check\"], timeout_s=600, command=\"bash cluster/bench/gpu_payload.sh smoke verdict 540\")"
  echo " $((n + 1)). give_back()"
  echo "results.jsonl and smoke-logs.tar.gz come back under the last call's files_at (commit the"
  echo "JSON lines); a second window runs the same calls with 'smoke perf 540'."
}

# There: keep the chunk(s) this call carries for the call that unpacks.
stash() {
  local chunks=${CHUNKS:-/root/up} p
  mkdir -p "$chunks"
  for p in $G/up*/part.*; do [ -f "$p" ] && cp -f "$p" "$chunks/"; done
  ls -l "$chunks"
  nvidia-smi -L 2>/dev/null || true
}

# A JSON object for the smoke step's details ($SMOKE_DETAILS), when the step runs under it.
details() { [ -n "${SMOKE_DETAILS:-}" ] && printf '%s\n' "$1" > "$SMOKE_DETAILS"; return 0; }

unpack() {
  local site=${SITE:-/tmp/site} chunks=${CHUNKS:-/root/up} py=${PYTHON:-python3}
  local want got p parts=() t0=$SECONDS unpacked=0 compiled_s pth_dir
  if [ ! -f $G/check/parts.txt ]; then
    if "$py" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('vllm', 'ray', 'deepspeed')))" 2>/dev/null; then
      details '{"payload": "none carried; vllm, ray and deepspeed are installed"}'; return 0
    fi
    details "{\"reason\": \"no payload ($G/check/parts.txt) and no vllm, ray and deepspeed here: nothing to unpack\"}"
    echo "no payload and no GPU stack here" >&2; return 77
  fi
  stash > /dev/null
  want=$(cut -d' ' -f1 $G/check/payload.sha256)
  if [ "$(cat "$site/.payload" 2>/dev/null)" != "$want" ]; then
    for p in $(cat $G/check/parts.txt); do
      [ -f "$chunks/$p" ] || { echo "chunk $p is missing: this is a fresh machine; make every chunk's call again, back to back" >&2; return 3; }
      parts+=("$chunks/$p")
    done
    got=$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "the chunks' sha256 is $got, the build's $want: chunks of two builds" >&2; return 3; }
    rm -rf "$site" && mkdir -p "$site"
    cat "${parts[@]}" | xz -d -T0 | tar -x -C "$site"
    echo "$want" > "$site/.payload"
    unpacked=$((SECONDS - t0))
    say "payload unpacked into $site ($(du -sm "$site" | cut -f1) MB) in ${unpacked}s"
  fi
  # The .pth file: the interpreter's first writable site-packages, else its user site.
  pth_dir=${PTH_DIR:-}
  [ -n "$pth_dir" ] || pth_dir=$("$py" -c 'import os, site
dirs = [d for d in site.getsitepackages() if os.path.isdir(d) and os.access(d, os.W_OK)]
print(dirs[0] if dirs else site.getusersitepackages())')
  mkdir -p "$pth_dir" && echo "$site" > "$pth_dir/klrl-payload.pth"
  t0=$SECONDS
  # -j 0: every core; -q: errors only (a py2-only file in a wheel's tests must not stop it);
  # the packages' own tests and examples are never imported
  "$py" -m compileall -q -j 0 -x '/(tests?|testing|examples|benchmarks)/' "$site" > /dev/null 2>&1 || true
  "$py" -m compileall -q -j 0 actors cluster kl learner rewards tests > /dev/null 2>&1 || true
  compiled_s=$((SECONDS - t0))
  export KLRL_HOME=${KLRL_HOME:-/tmp/klrl_home}
  [ -d "$KLRL_HOME/models" ] || { mkdir -p "$KLRL_HOME" && cp -r $G/check/klrl_home/. "$KLRL_HOME/"; }
  say "installed through $pth_dir/klrl-payload.pth; byte-compiled in ${compiled_s}s"
  details "{\"site\": \"$site\", \"pth\": \"$pth_dir/klrl-payload.pth\", \"unpack_s\": $unpacked, \"compile_s\": $compiled_s, \"site_mb\": $(du -sm "$site" | cut -f1)}"
}

# What every run there needs besides the payload.
device_env() {
  export PYTHONPATH=${SITE:-/tmp/site} KLRL_HOME=${KLRL_HOME:-/tmp/klrl_home}
  # vLLM 0.26's GPU sampler imports FlashInfer unless told not to; it is not carried.
  export VLLM_USE_FLASHINFER_SAMPLER=0 WANDB_MODE=disabled HF_HUB_OFFLINE=1
  export TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
  [ -f $G/check/commit.txt ] && export SMOKE_COMMIT=$(cat $G/check/commit.txt)
  return 0
}

smoke() {
  local window=${1:-verdict} deadline=${2:-540}
  device_env
  # the first step unpacks (timed, recorded like the others)
  "${PYTHON:-python3}" -m cluster.bench.gpu_smoke --window "$window" --deadline-s "$deadline" \
    --out "${OUT:-$ROOT/gpu-smoke-out}" --work "${SMOKE_WORK:-/tmp/klrl-smoke}"
}

check() {
  local budget=${1:-480} out=${OUT:-$ROOT/gpu-check-out}
  mkdir -p "$out"
  unpack  # its failure (set -e) ends the call with its code
  device_env
  [ -f $G/check/gpu-check.json ] && [ ! -f "$out/gpu-check.json" ] &&
    cp $G/check/gpu-check.json "$out/gpu-check.json"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "${PYTHON:-python3}" -m cluster.bench.gpu_check --budget-s "$budget" \
    --json "$out/gpu-check.json" --log "$out/gpu-check.log"
}

case "${1:-}" in
  build) build ;;
  chunks) chunks ;;
  calls) calls ;;
  stash) stash ;;
  unpack) unpack ;;
  smoke) shift; smoke "$@" ;;
  check) shift; check "$@" ;;
  *) echo "usage: $0 build | chunks | calls | stash | unpack | smoke [WINDOW] [DEADLINE_S] | check [BUDGET_S]" >&2; exit 2 ;;
esac
