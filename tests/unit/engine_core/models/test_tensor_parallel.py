"""Tensor parallelism in the model files (engine_core/layers/parallel.py): two ranks of gloo on
the CPU, each loading only its shard, give the logits of the whole model (prefill, then decode
steps through each rank's paged KV cache holding its heads) within float32's rounding; the
split's rules and its start-up errors."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from engine_core.layers import attention
from engine_core.layers.lm_head import LMHead
from engine_core.layers.ops import TorchOps
from engine_core.layers.parallel import HeadSplit, TensorParallel, split_error
from engine_core.models import model_class
from engine_core.models.parts import ModelKit
from engine_core.models.weights import checkpoint_files, load_model

BLOCK = 16
PROMPT, DECODES = 29, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load(folder: Path, tp: TensorParallel | None) -> Any:
    config = AutoConfig.from_pretrained(folder)
    return load_model(model_class(config), config, ModelKit(TorchOps(), attention.attend, tp),
                      checkpoint_files(folder), torch.float32, torch.device("cpu"), 256)


def _run(model: Any, head: LMHead, ids: torch.Tensor, tokens: list[int] | None = None
         ) -> tuple[list[Any], list[int]]:
    """Each step's scan and token: the prompt in one prefill, then DECODES decode steps (of
    `tokens`, else greedy), through a paged KV cache of the model's (this rank's) KV heads."""
    shape = model.shape
    blocks = -(-(len(ids) + DECODES) // BLOCK)
    caches = [(torch.zeros(blocks * BLOCK, shape.kv_heads, shape.head_dim),
               torch.zeros(blocks * BLOCK, shape.kv_heads, shape.head_dim))
              for _ in range(model.model.num_layers)]
    scans, chosen, step_ids, start = [], [], ids, 0
    for step in range(DECODES + 1):
        meta, positions = attention.build_metadata(
            np.array([start]), np.array([len(step_ids)]), np.arange(blocks)[None], BLOCK,
            caches, torch.device("cpu"))
        hidden = model.model(step_ids, torch.from_numpy(positions), meta)
        scans.append(head.scan(hidden[-1:], lse=True, top_k=5))
        chosen.append(int(scans[-1].argmax[0]) if tokens is None else tokens[step])
        start += len(step_ids)
        step_ids = torch.tensor(chosen[-1:])
    return scans, chosen


@torch.inference_mode()
def _check(folder: Path, tp: TensorParallel) -> None:
    whole, shard = _load(folder, None), _load(folder, tp)
    config = whole.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert shard.shape.heads == heads // tp.size
    assert shard.shape.kv_heads == max(1, kv_heads // tp.size)
    assert shard.model.embed_tokens.weight.shape[0] == -(-config.vocab_size // tp.size)
    ids = torch.randint(0, config.vocab_size, (PROMPT,),
                        generator=torch.Generator().manual_seed(3))
    want, tokens = _run(whole, LMHead(whole.head_weight), ids)
    got, _ = _run(shard, LMHead(shard.head_weight, tp=tp, vocab=config.vocab_size), ids, tokens)
    for w, g in zip(want, got, strict=True):
        assert g.logits.shape == w.logits.shape
        torch.testing.assert_close(g.logits, w.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g.lse, w.lse, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax, w.argmax) and torch.equal(g.top_ids, w.top_ids)


def _rank(rank: int, size: int, port: int, folders: list[Path]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        for folder in folders:
            _check(folder, TensorParallel(rank, size))
    finally:
        dist.destroy_process_group()


def few_kv_heads(folder: Path) -> Path:
    """A Llama with one KV head (fewer than the ranks), biases on every attention and MLP
    product (the row-parallel ones added once) and a vocabulary no rank count divides."""
    config = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                         max_position_embeddings=256, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def test_two_ranks_give_the_whole_models_logits(tiny_llama, tiny_qwen2, tmp_path):
    """The tiny Llama (4 heads, 2 KV heads), the tiny Qwen2 (q/k/v biases, which follow their
    heads) and a Llama with a single KV head, each at TP = 2 against TP = 1."""
    folders = [tiny_llama, tiny_qwen2, few_kv_heads(tmp_path / "kv1")]
    mp.spawn(_rank, args=(2, _free_port(), folders), nprocs=2, join=True)


def test_each_rank_holds_its_heads():
    assert TensorParallel(1, 2).heads(4, 2) == HeadSplit(2, 2, 1, 1)
    assert TensorParallel(3, 4).heads(8, 2) == HeadSplit(2, 6, 1, 1)  # KV head 1 on ranks 2, 3
    assert TensorParallel(1, 4).heads(8, 2) == HeadSplit(2, 2, 1, 0)
    assert TensorParallel(1, 2).vocab_rows(301) == 151


@pytest.mark.parametrize(("shape", "message"), [
    ((6, 2, 96, 4), "6 attention heads do not divide"),
    ((8, 3, 96, 2), "3 KV heads neither divide"),
    ((8, 8, 90, 4), "MLP width 90"),
])
def test_a_model_that_does_not_split_is_an_error_naming_why(shape, message):
    assert message in (split_error(*shape) or "")
    assert split_error(8, 2, 96, 4) is None and split_error(8, 1, 96, 8) is None
