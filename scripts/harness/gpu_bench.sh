#!/usr/bin/env bash
# One command for a GPU machine: install seqgen without dependencies, then run scripts/harness/gpu_bench.py
# (float32 equivalence on the device, host-sync audit, the bart-large-cnn and GPT-2 tables, refill vs
# --no-refill, the CLI, whole runs captured and not).
#
#   scripts/harness/gpu_bench.sh --out DIR [--shared DIR] [--stages equiv,sync,bart,long,gpt2,refill,cli,run] [--batches 32,64,128|max]
#   scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes float16   # one stage per 10-minute call
#   scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages refill --dtypes float16
#   scripts/harness/gpu_bench.sh --device cpu --quick --out DIR        # tiny shapes on the CPU (CI)
#
# Calls into the same --out add up (gpu_bench.py's docstring lists the calls that cover everything); --budget
# skips what would not fit and names the command that runs it.
#
# The shared folder: --shared DIR, else $SEQGEN_SHARED, else ../shared, else .gpu-shared in the checkout.
# ../shared does not travel to a GPU machine: run `python scripts/harness/gpu_bench.py --stage-shared` here first and
# carry '.gpu-shared'. Every other option goes to gpu_bench.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  # Carried wheels (e.g. transformers 5.23: 5.17 penalises left padding under repetition_penalty, so
  # generate() itself differs): `pip download --no-deps -d .whl transformers==5.23.0` here, carry '.whl'.
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/seqgen-site .whl/*.whl
  export PYTHONPATH="/tmp/seqgen-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import seqgen_cli" 2>/dev/null || [ "$("$PYTHON" -c 'import seqgen_cli, pathlib; print(pathlib.Path(seqgen_cli.__file__).resolve().parents[1])')" != "$(pwd -P)" ]; then
  # seqgen's dependencies are already there (torch, transformers, click, tqdm); rouge-score and ctranslate2
  # are not needed by `seqgen generate`. Without a usable setuptools, run from the checkout instead.
  if ! "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . 2>/tmp/seqgen-pip.log; then
    echo "gpu_bench: pip install failed (see /tmp/seqgen-pip.log); using PYTHONPATH=$(pwd -P)" >&2
  fi
fi
export PYTHONPATH="$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" scripts/harness/gpu_bench.py "$@"
