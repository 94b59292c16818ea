"""A draft model's proposals (speculative decoding's `draft_model` method), in the engine.

The draft is a small model with the target's tokenizer, loaded as the target is (loader.py, its
own model file, on the platform's ops and attention), with a paged KV cache of its own: the
same blocks as the target's (same ids, same block table, same slots), its own K and V in them.
It proposes greedily (q is one-hot: engine_core/sample/speculative.py stays exact); a
constrained request's drafts are its argmax under its grammar's mask, walked on a copy of its
matcher (the request's own matcher is the sampler's alone), so they are drafts the grammar
allows.

Proposals are made once a step is scheduled, for the requests it verifies: the scheduler has
then allocated the slots of the request's last token and its k drafts, which are where the
draft writes its own K/V. Per such request, at position p of its last token:

- a catch-up chunk: its tokens from the draft's first position without K/V up to p (the whole
  prompt at its first proposal; afterwards one token, or two when every draft was accepted),
  whose last row gives d_0;
- then k - 1 single-token forwards, d_{j-1} at position p + j, each giving d_j.

All the step's requests go through each forward together. The draft then has K/V below p + k;
after verification what is valid is below min(p + k, the new last token's position), which is
where the next catch-up starts (`Request.draft_computed` keeps p + k; the next proposal takes
the minimum). A preempted request starts over (its blocks are gone).

Under tensor parallelism the draft is not split: it runs whole in the engine process (rank
0), its forwards and its KV cache rank 0's alone; the workers never load it and its
forwards broadcast nothing. Only the target's verification step reaches the workers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig

from engine_core.config import EngineConfig
from engine_core.structured.grammar import RequestGrammar
from engine_core.structured.masks import TokenMasker, apply_bitmask
from engine_core.worker.loader import load
from engine_core.worker.platform import Platform

log = logging.getLogger(__name__)


class Drafter:
    def __init__(self, config: EngineConfig, platform: Platform, max_model_len: int,
                 target_vocab: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        # --quantization is the target's: the draft loads as its own checkpoint says (fp8
        # only if it is an fp8 checkpoint)
        draft_config = dataclasses.replace(config, model=spec.model, speculative=None,
                                           quantization=None, tensor_parallel_size=1)
        hf_config = AutoConfig.from_pretrained(spec.model,
                                               trust_remote_code=config.trust_remote_code)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if int(text.vocab_size) != target_vocab:
            raise ValueError(f"--speculative-config: the draft model's vocabulary "
                             f"({text.vocab_size}) is not the target's ({target_vocab}); a draft "
                             "model shares the target's tokenizer")
        loaded = load(draft_config, hf_config, platform, max_model_len)
        self.decoder = loaded.decoder
        self.head = loaded.head
        self.k = spec.num_speculative_tokens
        self.device = platform.device
        self.dtype = platform.dtype
        heads = text.num_attention_heads
        self.kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.layers = int(text.num_hidden_layers)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._masker: TokenMasker | None = None  # made at the first constrained request
        log.info("draft model %s (%s), %d tokens a proposal", spec.model, loaded.source, self.k)

    def block_bytes(self, block_size: int) -> int:
        """Its KV cache's bytes per block (the target's budget pays for both)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks * block_size, self.kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.layers)]

    @torch.inference_mode()
    def propose(self, requests: list[Any], counts: list[int], forward: Any) -> list[list[int]]:
        """Greedy drafts for `requests` (counts[i] for request i, each with its slots for them
        allocated), through `forward(starts, num_new, token_ids, requests, kv_caches)` ->
        hidden states at each request's last row (the runner's, with these caches)."""
        last = [len(r.all_token_ids) - 1 for r in requests]
        starts = np.array([min(r.draft_computed, p) for r, p in zip(requests, last)], np.int64)
        num_new = np.array(last, np.int64) + 1 - starts
        ids = np.concatenate([np.asarray(r.all_token_ids[s:], np.int64)
                              for r, s in zip(requests, starts.tolist())])
        drafts: list[list[int]] = [[] for _ in requests]
        active = list(range(len(requests)))
        # a constrained request's drafts follow its grammar, on a copy of its matcher
        walkers = {i: r.grammar.walker() for i, r in enumerate(requests) if r.masked}
        for j in range(max(counts)):
            hidden = forward(starts, num_new, ids, [requests[i] for i in active], self.kv_caches)
            tokens = self._greedy(hidden, [walkers.get(i) for i in active])
            for i, token in zip(active, tokens.tolist()):
                drafts[i].append(int(token))
                walker = walkers.get(i)
                if walker is not None and (not walker.accept(int(token)) or walker.terminated):
                    del walkers[i]  # its later drafts are never accepted (Drafts.limits)
            active_next = [i for i in active if len(drafts[i]) < counts[i]]
            keep = [a for a, i in enumerate(active) if i in set(active_next)]
            starts = (starts[keep] + num_new[keep]).astype(np.int64)
            num_new = np.ones(len(keep), np.int64)
            ids = tokens[keep].astype(np.int64)
            active = active_next
            if not active:
                break
        for r, p, k in zip(requests, last, counts):
            r.draft_computed = p + k
        return drafts

    def _greedy(self, hidden: torch.Tensor,
                grammars: list[RequestGrammar | None]) -> np.ndarray:
        """Each row's argmax, under its grammar's mask where it has one."""
        logits = hidden.float() @ self.head.weight.float().t()
        if self.head.bias is not None:
            logits += self.head.bias.float()
        rows = [a for a, g in enumerate(grammars) if g is not None]
        if rows:
            self._masker = self._masker or TokenMasker()
            masks = self._masker.fill(len(rows), logits.shape[1], range(len(rows)),
                                      [g for g in grammars if g is not None])
            at = torch.tensor(rows, device=logits.device)
            masked = logits[at]
            apply_bitmask(masked, masks)
            logits[at] = masked
        tokens: np.ndarray = logits.argmax(dim=-1).cpu().numpy()
        return tokens
