"""The model the runner runs: Tandem's own file for its family where there is one, else
transformers' module tree.

`load` reads config.json's `architectures` (engine_core/models/registry.py): a registered
class that accepts the config is built and loaded straight from the safetensors files
(engine_core/models/weights.py), and runs on the platform's ops and attention (its
`ModelKit`); its decoder also runs in pieces cut at each attention, for the piecewise CUDA
graphs. Anything else (another architecture, a config the file declines, a checkpoint
without safetensors files, or `--model-impl transformers`) loads through
`AutoModelForCausalLM` with the platform's attention registered as transformers' attention
function, as vLLM's transformers backend runs what it has no file for.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM

from engine_core.config import EngineConfig
from engine_core.layers import attention, attention_cuda
from engine_core.layers.parallel import TensorParallel
from engine_core.models import model_class
from engine_core.models.parts import ModelKit, Part
from engine_core.models.quantization import fp8_scheme
from engine_core.models.weights import checkpoint_files, load_model, local_folder
from engine_core.worker.platform import AttentionBackend, Platform

log = logging.getLogger(__name__)
ATTENTION_NAMES: dict[AttentionBackend, str] = {"portable": "tandem_paged",
                                                "native": "tandem_paged",  # the same function
                                                "cuda": "tandem_paged_cuda"}
AttentionInterface.register(ATTENTION_NAMES["portable"], attention.paged_attention)
AttentionInterface.register(ATTENTION_NAMES["cuda"], attention_cuda.cuda_paged_attention)


class Head(NamedTuple):
    weight: torch.Tensor  # [vocab, hidden]
    bias: torch.Tensor | None
    softcap: float | None


class Loaded(NamedTuple):
    """decoder(ids [T], positions [T], attention metadata) -> the final hidden states
    [T, hidden]; `pieces` the same decoder when it also runs in pieces (Tandem's files), else
    None; `source` says which, for the log."""

    decoder: nn.Module
    head: Head
    pieces: Any | None
    source: str
    parts: dict[str, Part] | None = None  # Tandem's files: the merged products' parts


class HFDecoder(nn.Module):
    """transformers' decoder (the causal LM's `get_decoder()`) called as Tandem's are."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        out = self.decoder(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                           tandem_meta=meta)
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden


def load(config: EngineConfig, hf_config: Any, platform: Platform, max_model_len: int,
         tp: TensorParallel | None = None) -> Loaded:
    """The model, or with `tp` this rank's shard of it (Tandem's own files only)."""
    files, why = _own_checkpoint(config, hf_config, max_model_len)
    if tp is not None and not files:
        raise ValueError(f"--tensor-parallel-size {tp.size} needs Tandem's own model file and "
                         f"a safetensors checkpoint; this model runs through transformers "
                         f"({why})")
    fp8 = fp8_scheme(hf_config, config.quantization)
    if fp8 is not None and not files:
        raise ValueError(f"fp8 weights need Tandem's own model file and a safetensors "
                         f"checkpoint; this model runs through transformers ({why})")
    if files:
        cls = model_class(hf_config)
        kit = ModelKit(platform.layer_ops(),
                       attention_cuda.attend if platform.attention == "cuda" else attention.attend,
                       tp)
        own = load_model(cls, hf_config, kit, files, platform.dtype, platform.device,
                         max_model_len, fp8, platform.fp8_scaled_mm)
        quantized = "" if fp8 is None else ", " + fp8.describe() + (
            " on torch._scaled_mm" if platform.fp8_scaled_mm else ", dequantized per product")
        return Loaded(own.model, Head(own.head_weight, None, None), own.model,
                      f"Tandem's {cls.__module__.rsplit('.', 1)[-1]}.py with "
                      f"{type(kit.ops).__name__}{quantized}", own.packed())
    model: Any = AutoModelForCausalLM.from_pretrained(
        config.model, config=hf_config, dtype=platform.dtype,
        attn_implementation=ATTENTION_NAMES[platform.attention],
        trust_remote_code=config.trust_remote_code, **_placement(platform.device))
    model = model.to(platform.device).eval()  # (there already, when loaded in place)
    lm_head = model.get_output_embeddings()
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    head = Head(lm_head.weight, getattr(lm_head, "bias", None),
                getattr(text, "final_logit_softcapping", None))
    return Loaded(HFDecoder(model.get_decoder()), head, None, f"transformers ({why})")


def split_problem(hf_config: Any, config: EngineConfig) -> str | None:
    """Why the model cannot be split over --tensor-parallel-size ranks, or None; checked
    before any worker starts."""
    size = config.tensor_parallel_size
    cls = model_class(hf_config)
    if cls is None or config.model_impl == "transformers":
        return (f"--tensor-parallel-size {size} needs Tandem's own model file (Llama, Qwen2, "
                f"Qwen3); {', '.join(hf_config.architectures or ['?'])} runs through "
                "transformers")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    why = cls.tp_error(text, size)
    return None if why is None else f"--tensor-parallel-size {size}: {why}"


def _own_checkpoint(config: EngineConfig, hf_config: Any, max_model_len: int
                    ) -> tuple[list[Path], str]:
    """The safetensors files for Tandem's own model file, or none and why the model runs
    through transformers."""
    if config.model_impl == "transformers":
        return [], "--model-impl transformers"
    cls = model_class(hf_config)
    files: list[Path] = []
    if cls is None:
        why = f"no Tandem model file for {', '.join(hf_config.architectures or ['?'])}"
    else:
        why = cls.unsupported(hf_config, max_model_len) or ""
        folder = None if why else local_folder(config.model)
        files = checkpoint_files(folder) if folder is not None else []
        if not why and not files:
            why = "no safetensors checkpoint"
    if why and config.model_impl == "tandem":
        raise ValueError(f"--model-impl tandem: {why}")
    return files, why


def _placement(device: torch.device) -> dict[str, Any]:
    """from_pretrained's arguments that load the weights straight onto an accelerator: its
    device_map, which transformers honours through accelerate; without accelerate (or on the
    CPU) the weights load on the host and are moved."""
    if device.type == "cpu" or importlib.util.find_spec("accelerate") is None:
        return {}
    return {"device_map": str(device)}
