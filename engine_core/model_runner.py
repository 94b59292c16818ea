"""Loads a Hugging Face causal LM and runs one packed forward per engine step.

Why transformers' own model classes and not hand-written ones: registering a paged-attention
function through `AttentionInterface` lets Llama, Qwen2, Mistral (and every other decoder
whose attention goes through that interface) run packed, mixed prefill+decode batches with
tokens identical to `generate()`. Measured on this 2-core CPU (tests/bench/engine_throughput.py
and the prototype in DESIGN.md) the Python overhead of HF's module tree is ~4.5 ms per step
against ~2.2 ms for a hand-written Llama, which only matters for tiny models at small batch;
at batch >= 8 on a 100M model the two are equal, and the LM head dominates anyway. One code
path for every architecture, exact parity and no weight-loading code to keep win.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine_core.attention import build_metadata, paged_attention
from engine_core.config import EngineConfig
from engine_core.lm_head import LMHead
from engine_core.scheduler import SchedulerOutput

log = logging.getLogger(__name__)
ATTENTION_NAME = "tandem_paged"
AttentionInterface.register(ATTENTION_NAME, paged_attention)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass(frozen=True)
class ModelFacts:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, config=hf_config, dtype=self.dtype, attn_implementation=ATTENTION_NAME,
            trust_remote_code=config.trust_remote_code).to(self.device).eval()
        self.decoder = self.model.get_decoder()
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        lm_head = self.model.get_output_embeddings()
        self.head = LMHead(lm_head.weight, getattr(lm_head, "bias", None),
                           getattr(text_config, "final_logit_softcapping", None),
                           workers=_head_workers(self.device))
        self.facts = _model_facts(config, hf_config)
        self.block_size = config.block_size
        self.kv_caches = self._allocate_kv(config, hf_config)
        log.info("model %s on %s/%s, %d KV blocks of %d tokens", config.model, self.device,
                 self.dtype, self.num_blocks, self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0] // self.block_size

    def _allocate_kv(self, config: EngineConfig, hf: AutoConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layers = text.num_hidden_layers
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_block = 2 * layers * self.block_size * kv_heads * head_dim * elem
        num_blocks = config.num_kv_blocks or max(1, self._kv_budget(config) // per_block)
        shape = (num_blocks * self.block_size, kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(layers)]

    def _kv_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return _CPU_DEFAULT_KV_BYTES

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


def _head_workers(device: torch.device) -> int:
    """Threads for the LM head's vocabulary chunks: every core when torch itself runs on one
    thread (small CPU boxes, where the frontends share the cores: chunks taken on demand
    tolerate a busy core, torch's OpenMP split does not); else torch's own threads do it."""
    if device.type != "cpu" or torch.get_num_threads() > 1:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _model_facts(config: EngineConfig, hf: AutoConfig) -> ModelFacts:
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    max_len = config.max_model_len or getattr(text, "max_position_embeddings", None) or 2048
    eos: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(config.model)
        eos += _as_list(gen.eos_token_id)
    except OSError:
        pass
    eos += [e for e in _as_list(text.eos_token_id) if e not in eos]
    return ModelFacts(int(max_len), int(text.vocab_size), tuple(eos), text.bos_token_id)


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
