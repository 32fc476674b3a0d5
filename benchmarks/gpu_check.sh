#!/usr/bin/env bash
# The CUDA path on a one-GPU machine, in one go (about 7 minutes on an H200, 2026-12-04): the default
# recipe on cuda with its memory metrics checked, then llm_1b on one GPU in bf16 (eager, compiled,
# float8 rowwise and tensorwise compiled against bf16 after 50 steps and again at micro batch 4, AC
# from none through per-op and memory budgets 0.7/0.5/0.3 to full, fsdp.cpu_offload, one profiled
# step broken down by kernel kind), each with tokens/s, MFU and peak memory beside `meshforge
# estimate` and tune's predicted step. Writes benchmarks/results/gpu_check.{json,md} (or --out DIR)
# and the profiled step's trace beside them; --merge writes parts run with --only as one record.
#
#   bash benchmarks/gpu_check.sh [--steps 30] [--out DIR] [--only name,name] [--run-timeout S] [--dry-run]
#
# It installs meshforge (editable, no dependencies fetched) into the python it finds when
# meshforge is not importable yet; wheels in .whl/ (for a machine without network) go first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ! "$PY" -c "import omegaconf, tomli_w" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/meshforge_site .whl/*.whl
  export PYTHONPATH=/tmp/meshforge_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import meshforge.run.train.trainer" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1 MESHFORGE_LOG_LEVEL=${MESHFORGE_LOG_LEVEL:-WARNING}
exec "$PY" benchmarks/gpu_check.py "$@"
