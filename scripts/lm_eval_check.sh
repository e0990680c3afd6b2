#!/usr/bin/env bash
# lm-evaluation-harness as a real client: lm_eval 0.4.13's `local-completions` model against our
# server on the embedded pair, on two tasks defined on local JSONL files (scripts/lm_eval/):
#   jetflow_mc   multiple choice by loglikelihood (echo + logprobs, max_tokens 1)
#   jetflow_gen  generate_until (greedy, until the end of the line)
# then scripts/lm_eval/compare.py computes the same scores from the target directly
# (transformers, float32), prints both, and exits non-zero if the scores or any item differ.
#
#   scripts/lm_eval_check.sh                # one run; not part of CI
#
# First use installs 'lm-eval[api]==0.4.13' and transformers into a venv of its own ($VENV,
# default runs/lm_eval/venv: ~940 MB, about 1.5 min; no torch); the server and compare.py run
# in the project's ($PY). Everything runs offline (HF_*_OFFLINE): the tasks, the tokenizer and
# the target are local files. The server's log and lm_eval's output land in $WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/lm_eval}
VENV=${VENV:-$WORK/venv}
METHOD=${METHOD:-jetflow}  # the server's --method
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

mkdir -p "$WORK"
if [ ! -x "$VENV/bin/lm_eval" ]; then
  echo "installing lm-eval[api]==0.4.13 into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet 'lm-eval[api]==0.4.13' transformers
fi

TARGET=$($PY -c 'from jetflow_jax import embedded; print(embedded.default_target())')
PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
# The server requires a key, as one others reach would; lm_eval sends $OPENAI_API_KEY.
KEY=$($PY -c 'import secrets; print(secrets.token_hex(16))')
JETFLOW_API_KEY=$KEY $PY -m jetflow_jax.serve --method "$METHOD" --slots 4 --max-context 512 \
    --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2> /dev/null; wait $SERVER 2> /dev/null || true' EXIT
echo "server (pid $SERVER, $METHOD) warming up on $URL; log: $WORK/server.log"
$PY - "$URL" "$SERVER" <<'PYTHON'
import os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 900
while True:
  try:
    with urllib.request.urlopen(f"{url}/health", timeout=5):
      break
  except OSError:
    os.kill(pid, 0)  # raises once the server has exited
    if time.monotonic() > deadline:
      sys.exit("the server was not up within 900 s")
    time.sleep(1)
PYTHON

rm -rf "$WORK/out"
OPENAI_API_KEY=$KEY "$VENV/bin/lm_eval" --model local-completions \
    --model_args "base_url=$URL/v1/completions,model=jetflow-embedded,tokenizer=$TARGET,tokenizer_backend=huggingface,max_length=512,num_concurrent=1,max_retries=1" \
    --tasks jetflow_mc,jetflow_gen --include_path scripts/lm_eval \
    --output_path "$WORK/out" --log_samples
$PY scripts/lm_eval/compare.py "$WORK/out"
