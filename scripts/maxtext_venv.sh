#!/usr/bin/env bash
# A MaxText environment for scripts/maxtext_check.py: MaxText 0.2.5 needs Python >= 3.12, and its
# wheel puts every dependency behind accelerator extras (~235 packages each); this is the CPU set
# its decoder needs (measured: 145 s, 1.4 GB with a warm pip cache).
#
#   bash scripts/maxtext_venv.sh [/work/maxtext-venv] [python3.12]
set -euo pipefail
VENV=${1:-/work/maxtext-venv}
PY=${2:-$(command -v python3.12 || ls -d ~/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "maxtext==0.2.5" --no-deps
"$VENV/bin/pip" install -q "jax[cpu]" flax orbax-checkpoint optax omegaconf pydantic absl-py numpy \
  ml-collections jaxtyping chex packaging pathwaysutils jinja2 qwix aqtp tokamax huggingface_hub \
  transformers grain drjax pillow tiktoken sentencepiece sympy
"$VENV/bin/python" -c "from maxtext.utils import model_creation_utils; print('maxtext ready')"
