"""Tandem's own model files, one per family, for the forward at the device's pace.

`registry.py` maps config.json's `architectures` to a class; `weights.py` loads a class's
weights straight from the safetensors files (merging q/k/v and gate/up as they load). Any other
architecture, or a config a file declines, runs through transformers' module tree
(engine_core/worker/model_runner.py), as vLLM's transformers backend does.
"""

from engine_core.models import llama, qwen2, qwen3  # noqa: F401  (each registers its classes)
from engine_core.models.registry import MODELS, model_class

__all__ = ["MODELS", "model_class"]
