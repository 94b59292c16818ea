"""Loads a Hugging Face causal LM and runs one packed forward per engine step.

Why transformers' own model classes and not hand-written ones: registering a paged-attention
function through `AttentionInterface` lets Llama, Qwen2, Mistral (and every other decoder
whose attention goes through that interface) run packed, mixed prefill+decode batches with
tokens identical to `generate()`. The Python overhead of HF's module tree over a hand-written
Llama only matters for tiny models at small batch (docs/benchmarks.md). One code path for
every architecture, exact parity and no weight-loading code to keep win.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine_core.attention import build_metadata, paged_attention
from engine_core.config import EngineConfig
from engine_core.linear import transpose_linears
from engine_core.lm_head import LMHead
from engine_core.platform import Platform
from engine_core.scheduler import SchedulerOutput

log = logging.getLogger(__name__)
ATTENTION_NAME = "tandem_paged"
AttentionInterface.register(ATTENTION_NAME, paged_attention)


@dataclass(frozen=True)
class ModelFacts:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sampling_defaults: tuple[tuple[str, int | float], ...] = ()  # per --generation-config


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.device = platform.device
        self.dtype = platform.dtype
        hf_config = AutoConfig.from_pretrained(config.model,
                                               trust_remote_code=config.trust_remote_code)
        # transformers' auto classes are typed loosely: the model is used through its own API
        model: Any = AutoModelForCausalLM.from_pretrained(
            config.model, config=hf_config, dtype=self.dtype, attn_implementation=ATTENTION_NAME,
            trust_remote_code=config.trust_remote_code)
        self.model = model.to(self.device).eval()
        self.decoder = self.model.get_decoder()
        if platform.transposed_linears:
            transpose_linears(self.decoder)
        text = _text_config(hf_config)
        lm_head = self.model.get_output_embeddings()
        self.head = LMHead(lm_head.weight, getattr(lm_head, "bias", None),
                           getattr(text, "final_logit_softcapping", None),
                           kernels=platform.head_kernels, workers=platform.head_workers,
                           chunk=platform.head_chunk)
        self.facts = _model_facts(config, text)
        self.block_size = config.block_size
        self.kv_caches = self._allocate_kv(config, text, platform.kv_cache_budget())
        log.info("model %s on %s/%s, %d KV blocks of %d tokens, LM head on %s ops, decoder "
                 "linears %s", config.model, self.device, self.dtype, self.num_blocks,
                 self.block_size, self.head.backend,
                 "transposed" if platform.transposed_linears else "as torch has them")

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0] // self.block_size

    def _allocate_kv(self, config: EngineConfig, text: Any,
                     budget: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layers = text.num_hidden_layers
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_block = 2 * layers * self.block_size * kv_heads * head_dim * elem
        num_blocks = config.num_kv_blocks or max(1, budget // per_block)
        shape = (num_blocks * self.block_size, kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(layers)]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, keep_rows: np.ndarray) -> torch.Tensor:
        """Run every scheduled token in one forward; return the final hidden states at
        `keep_rows` (the LM head runs later, in `self.head`, on just the rows that need it)."""
        items = sched.scheduled
        starts = np.fromiter((s.start for s in items), dtype=np.int64, count=len(items))
        num_new = np.fromiter((s.num_new for s in items), dtype=np.int64, count=len(items))
        width = max(len(s.request.block_ids) for s in items)
        table = np.zeros((len(items), width), dtype=np.int64)
        token_ids: list[int] = []
        for i, s in enumerate(items):
            table[i, :len(s.request.block_ids)] = s.request.block_ids
            token_ids.extend(s.request.all_token_ids[s.start:s.start + s.num_new])
        meta, positions = build_metadata(starts, num_new, table, self.block_size,
                                         self.kv_caches, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[None]
        position_ids = torch.from_numpy(positions).to(self.device)[None]
        keep = torch.from_numpy(keep_rows).to(self.device)
        out = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           tandem_meta=meta)
        return out.last_hidden_state[0, keep]


def _text_config(hf: Any) -> Any:
    """The text model's config (a multimodal config nests it); its fields depend on the
    architecture, so it is typed as Any."""
    return hf.get_text_config() if hasattr(hf, "get_text_config") else hf


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _model_facts(config: EngineConfig, text: Any) -> ModelFacts:
    max_len = config.max_model_len or getattr(text, "max_position_embeddings", None) or 2048
    eos: list[int] = []
    gen = _generation_config(config.model)
    if gen is not None:
        eos += _as_list(gen.eos_token_id)
    eos += [e for e in _as_list(text.eos_token_id) if e not in eos]
    return ModelFacts(int(max_len), int(text.vocab_size), tuple(eos), text.bos_token_id,
                      sampling_defaults(config))


def _generation_config(folder: str) -> GenerationConfig | None:
    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:
        return None


def sampling_defaults(config: EngineConfig) -> tuple[tuple[str, int | float], ...]:
    """The sampling values the model's generation config sets (only those it sets, as vLLM's
    'auto' reads them); none with --generation-config vllm."""
    if config.generation_config == "vllm":
        return ()
    folder = config.model if config.generation_config == "auto" else config.generation_config
    gen = _generation_config(folder)
    if gen is None:
        if config.generation_config != "auto":
            raise ValueError(f"--generation-config {folder}: no generation_config.json there")
        return ()
    given = gen.to_diff_dict()
    return tuple((key, given[key]) for key in SAMPLING_KEYS
                 if isinstance(given.get(key), (int, float)))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
