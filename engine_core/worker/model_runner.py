"""Runs the model: one packed forward per engine step, over the paged KV cache.

The model is Tandem's own file for its family where there is one, else transformers' module
tree (loader.py). Writing the forward in the repo is what a GPU needs: transformers' tree
launches one kernel (and one trip through memory) per small op, some 660 a decode step of a
1B model, which CUDA graphs replay without their launch cost but not their GPU cost; the
model files run merged products and fused ops (engine_core/layers/ops.py) instead, about ten
kernels a layer (docs/gpu.md). On the CPU the same files run the compiled C kernels.

The attention is the platform's (`Platform.attention`): the portable torch path
(attention.py) or the CUDA kernels (attention_cuda.py). A step's inputs come from the
persistent block table (input_batch.py) and reach the device without a host sync
(host_link.py); decode-only steps replay CUDA graphs where the platform captures them
(cuda_graphs.py), and the other steps of a model file's run in CUDA graphs between its
attentions (piecewise.py). Where the KV cache is sized from the device's memory
(`Platform.profiles_memory`), one step at the largest budget is run and measured first, the
sampler's costliest case included (memory_profile.py), and the graphs' memory is set aside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import AutoConfig, GenerationConfig

from engine_core.config import EngineConfig
from engine_core.layers import attention, attention_cuda, native, triton_attention
from engine_core.layers.chunk_pool import ChunkPool
from engine_core.layers.linear import prepare_linears
from engine_core.layers.lm_head import LMHead
from engine_core.layers.parallel import TensorParallel
from engine_core.lora import triton_lora
from engine_core.lora.slots import LoRASlots, token_slots
from engine_core.quant import fp8_kv
from engine_core.sample.device_sampler import DeviceSampler, HeadWeights
from engine_core.sched.scheduler import SchedulerOutput
from engine_core.worker.cuda_graphs import Agreement, GraphRunner, reserve_bytes
from engine_core.worker.drafter import Drafter
from engine_core.worker.input_batch import BlockTables, StepInputs, StepRows
from engine_core.worker.loader import load, split_problem
from engine_core.worker.memory_profile import StepMemory, max_useful_blocks, measure_step
from engine_core.worker.piecewise import PiecewiseRunner
from engine_core.worker.platform import AttentionBackend, Platform
from engine_core.worker.tensor_parallel import GraphCounts, Rank, Workers

log = logging.getLogger(__name__)
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class TableView(NamedTuple):
    """A step's block tables: `host` [R, W] int32 and its copy on the device; sequence i's
    blocks are row `rows[i]`."""

    host: np.ndarray
    device: torch.Tensor
    rows: np.ndarray


# (starts, num_new, tables, kv_caches) -> (the step's attention metadata, positions)
MetadataBuilder = Callable[[np.ndarray, np.ndarray, TableView, KVCaches], tuple[Any, np.ndarray]]


@dataclass(frozen=True)
class ModelFacts:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sampling_defaults: tuple[tuple[str, int | float], ...] = ()  # per --generation-config
    hidden_size: int = 0  # an embedding's width
    # the widths an embedding may be cut to (a Matryoshka model's; empty: any), or None
    matryoshka_dimensions: tuple[int, ...] | None = None


class KVShape(NamedTuple):
    layers: int
    kv_heads: int
    head_dim: int

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * elem


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform, rank: Rank | None = None
                 ) -> None:
        """`rank`: a tensor-parallel worker's place in its group; without it, with
        --tensor-parallel-size N > 1, this runner is rank 0 and starts the N - 1 workers
        (tensor_parallel.py)."""
        self.hf_config = AutoConfig.from_pretrained(config.model,
                                                    trust_remote_code=config.trust_remote_code)
        text = _text_config(self.hf_config)
        self.workers = (Workers(config, platform, split_problem(self.hf_config, config),
                                ModelRunner)
                        if rank is None and config.tensor_parallel_size > 1 else None)
        self.rank = rank if self.workers is None else self.workers.rank
        tp = None if self.rank is None else self.rank.tp
        self.device = platform.device
        self.dtype = platform.dtype
        self.link = platform.host_link()
        self.facts = _model_facts(config, text)
        loaded = load(config, self.hf_config, platform, self.facts.max_model_len, tp)
        self.decoder = loaded.decoder
        self.pieces = loaded.pieces  # the decoder in pieces, where it runs so (piecewise.py)
        self.piecewise: PiecewiseRunner | None = None  # captured once the KV cache is
        workers = platform.linear_workers
        self.linear_pool = None if workers is None else ChunkPool(workers, "linears")
        linears = prepare_linears(self.decoder, platform.transposed_linears,
                                  platform.head_kernels, platform.decoder_panels, self.linear_pool)
        self.lora: LoRASlots | None = None  # --enable-lora: the adapters' slots
        if config.enable_lora:
            if loaded.parts is None:
                raise ValueError("--enable-lora needs Tandem's own model file (Llama, Qwen2, "
                                 f"Qwen3); this model runs through {loaded.source}")
            # the kernels' slot buffer covers every step: eager ones and the graphs' sizes
            self.lora = LoRASlots(
                self.decoder, loaded.parts, config.max_loras, config.max_lora_rank, self.dtype,
                self.device, triton_lora.device_kernels() if platform.lora_kernels else None,
                max((platform.max_num_batched_tokens, *platform.cuda_graph_sizes,
                     *platform.piecewise_sizes)))
        head = loaded.head
        self.head = LMHead(head.weight, head.bias, head.softcap, kernels=platform.head_kernels,
                           workers=platform.head_workers, chunk=platform.head_chunk, tp=tp,
                           vocab=int(text.vocab_size),
                           announce=None if self.workers is None
                           else self.workers.rank.channel.send_head)
        self.head_weights = HeadWeights(head.weight, head.bias, head.softcap)
        self.block_size = config.block_size
        self.kv_shape = _kv_shape(text, tp)
        self.cache_dtype = fp8_kv.cache_dtype(config.kv_cache_dtype, self.dtype)
        self.kv_scales = (None if self.cache_dtype != fp8_kv.FP8
                          else _kv_scales(config, self.hf_config, self.kv_shape.layers,
                                          self.device, tp))
        self.kv_caches: KVCaches = []
        self.kernels = (attention_cuda.cuda_kernels(self.dtype, platform.triton_decode,
                                                    platform.triton_kv_write, self.device)
                        if platform.attention == "cuda" else None)
        self._metadata = self._metadata_builder(platform.attention, platform.head_kernels)
        spec = config.speculative  # a draft model runs whole on rank 0 only (drafter.py)
        self.drafter = (Drafter(config, platform, self.facts.max_model_len,
                                self.facts.vocab_size)
                        if spec is not None and spec.kind == "draft_model" and rank is None
                        else None)
        cuda_path = platform.attention == "cuda"
        graph_sizes = platform.cuda_graph_sizes if cuda_path else ()
        piece_sizes = platform.piecewise_sizes if cuda_path and self.pieces is not None else ()
        self.num_blocks = self._num_blocks(config, platform, graph_sizes, piece_sizes)
        if self.rank is not None:  # every rank's cache holds as many blocks: the smallest's
            self.num_blocks = self.rank.channel.smallest(self.num_blocks)
        # graphs' padded rows write their K/V into one more block, never handed out
        self.kv_caches = self._allocate_kv(self.num_blocks + (1 if graph_sizes else 0))
        if self.drafter is not None:  # its K/V in the same blocks as the target's
            self.drafter.allocate(self.num_blocks + (1 if graph_sizes else 0), self.block_size)
        self.tables = BlockTables(platform.max_num_seqs,
                                  -(-self.facts.max_model_len // self.block_size),
                                  self.block_size, self.device, self.link,
                                  dummy_block=self.num_blocks)
        self.graphs = self._capture(graph_sizes) if graph_sizes else None
        if piece_sizes:
            self.piecewise = self._capture_pieces(piece_sizes)
        log.info("model %s (%s) on %s/%s, %d KV blocks of %d tokens in %s, %s attention, LM "
                 "head on %s ops, decoder linears %s; decode steps %s%s", config.model,
                 loaded.source, self.device, self.dtype, self.num_blocks, self.block_size,
                 _dtype_name(self.cache_dtype), platform.attention,
                 self.head.backend, linears,
                 f"in CUDA graphs of {len(self.graphs.graphs)} sizes up to "
                 f"{self.graphs.max_size}" if self.graphs and self.graphs.graphs else "eager",
                 f"; other steps of up to {self.piecewise.max_size} tokens in piecewise graphs"
                 if self.piecewise and self.piecewise.graphs else "")

    def _num_blocks(self, config: EngineConfig, platform: Platform,
                    graph_sizes: tuple[int, ...], piece_sizes: tuple[int, ...]) -> int:
        """--num-kv-blocks; else the budget's blocks, and where the budget is profiled (the
        graphs' memory set aside), no more than max_num_seqs sequences of max_model_len
        tokens can fill."""
        if config.num_kv_blocks:
            return config.num_kv_blocks
        per_block = self.kv_shape.block_bytes(self.block_size, self.cache_dtype) + (
            0 if self.drafter is None else self.drafter.block_bytes(self.block_size))
        if not platform.profiles_memory:
            return max(1, platform.kv_cache_budget() // per_block)
        measured = self.profile_step(platform.max_num_batched_tokens, platform.max_num_seqs)
        torch.cuda.empty_cache()  # the stand-in cache's memory back (a no-op without CUDA)
        tokens = platform.max_num_batched_tokens
        layers = self.kv_shape.layers
        graphs = (reserve_bytes(graph_sizes, measured.peak, tokens)
                  + reserve_bytes(piece_sizes, measured.peak, tokens, (layers + 1) / layers))
        budget = platform.kv_cache_budget(measured) - graphs
        useful = max_useful_blocks(platform.max_num_seqs, self.facts.max_model_len,
                                   self.block_size)
        log.info("memory profile: weights %.2f GiB, step peak %.2f GiB, outside torch %.2f "
                 "GiB, CUDA graphs %.2f GiB; KV cache %.2f GiB", measured.weights / 2**30,
                 measured.peak / 2**30, measured.outside_torch / 2**30, graphs / 2**30,
                 min(budget, useful * per_block) / 2**30)
        return max(1, min(budget // per_block, useful))

    def _capture(self, sizes: tuple[int, ...]) -> GraphRunner:
        """The decode graphs (cuda_graphs.py), captured now; on the CPU their eager stand-in."""
        cuda = self.device.type == "cuda"
        graphs = GraphRunner(sizes, self._graph_forward, self.device, pinned=cuda,
                             dummy_slot=self.num_blocks * self.block_size,
                             dummy_row=self.tables.dummy_row, stand_in=not cuda)
        before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        with torch.inference_mode():
            graphs.capture(self._agreement())
        if cuda:
            log.info("CUDA graphs of %d sizes took %.2f GiB", len(graphs.graphs),
                     (before - torch.cuda.mem_get_info(self.device)[0]) / 2**30)
        return graphs

    def _capture_pieces(self, sizes: tuple[int, ...]) -> PiecewiseRunner:
        """The piecewise graphs (piecewise.py), captured now; on the CPU their stand-in."""
        cuda = self.device.type == "cuda"
        runner = PiecewiseRunner(sizes, self.pieces, self.device, self.dtype, stand_in=not cuda)
        before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        with torch.inference_mode():
            runner.capture(self._agreement())
        if cuda:
            log.info("piecewise CUDA graphs of %d token counts up to %d took %.2f GiB",
                     len(runner.graphs), runner.max_size,
                     (before - torch.cuda.mem_get_info(self.device)[0]) / 2**30)
        return runner

    def _agreement(self) -> Agreement | None:
        """How the tensor-parallel ranks agree that each graph captured (None: one rank)."""
        return None if self.rank is None else self.rank.channel.all_agree

    def graph_counts(self) -> GraphCounts:
        """This rank's graphs: sizes captured and replays, decode and piecewise."""
        graphs, pieces = self.graphs, self.piecewise
        return GraphCounts(len(graphs.graphs) if graphs else 0,
                           sum(graphs.replays.values()) if graphs else 0,
                           len(pieces.graphs) if pieces else 0,
                           sum(pieces.replays.values()) if pieces else 0)

    def _graph_forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       table_rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """A decode-only step's forward on the graphs' buffers: nothing decided on the host
        but the sizes (a graph captures it)."""
        assert self.kernels is not None
        splits = triton_attention.splits_for(len(ids), self.kv_shape.kv_heads, None)
        decode = attention_cuda.Decode(None, self.tables.device, table_rows, seq_lens, splits)
        meta = attention_cuda.CudaAttentionMetadata(slots, self.block_size, None, decode,
                                                    self.kv_caches, self.kernels, self.kv_scales)
        hidden: torch.Tensor = self.decoder(ids, positions, meta)
        return hidden

    def _allocate_kv(self, num_blocks: int) -> KVCaches:
        shape = (num_blocks * self.block_size, self.kv_shape.kv_heads, self.kv_shape.head_dim)
        return [(torch.zeros(shape, dtype=self.cache_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.cache_dtype, device=self.device))
                for _ in range(self.kv_shape.layers)]

    def _metadata_builder(self, backend: AttentionBackend,
                          cpu_kernels: native.Kernels | None) -> MetadataBuilder:
        block_size, link, kernels, scales = self.block_size, self.link, self.kernels, self.kv_scales
        if backend == "cuda":
            assert kernels is not None
            return lambda starts, num_new, t, caches: attention_cuda.build_metadata(
                starts, num_new, t.host, t.rows, t.device, block_size, caches, link, kernels,
                scales)
        decodes = cpu_kernels if backend == "native" else None
        pool = self.linear_pool  # (prefill chunks' attention shared over the linears' threads)

        def portable(starts: np.ndarray, num_new: np.ndarray, t: TableView,
                     caches: KVCaches) -> tuple[Any, np.ndarray]:
            width = max(1, -(-int((starts + num_new).max()) // block_size))
            return attention.build_metadata(starts, num_new, t.host[t.rows, :width], block_size,
                                            caches, link.device, decodes, scales, pool)

        return portable

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, keep_rows: np.ndarray,
                previous: torch.Tensor | None = None) -> tuple[torch.Tensor, StepRows]:
        """Run every scheduled token in one forward; return the final hidden states at
        `keep_rows` (the LM head runs later, in `self.head`, on just the rows that need it),
        and where the step's requests are in the block table (for `note_sampled`).
        `previous`: the previous step's sampled tokens, on the device, where an overlapped
        step left placeholders for them (moved there if a host sampler made them). Under
        tensor parallelism the step goes to the workers first (`_send_step`)."""
        inputs = self.tables.inputs(sched)
        if self.lora is not None:
            self.lora.context.set(token_slots([r.lora_slot for r in sched.requests],
                                              inputs.num_new))
        if previous is not None and previous.device != self.device:
            previous = previous.to(self.device, non_blocking=True)
        size = self.graphs.size_for(inputs) if self.graphs is not None else None
        tables = TableView(self.tables.host, self.tables.device, inputs.rows.rows)
        if self.workers is not None:
            self._send_step(inputs, tables, keep_rows, size,
                            previous if len(inputs.pending_rows) else None)
        return self._run(inputs, tables, keep_rows, size, previous), inputs.rows

    def _run(self, inputs: StepInputs, tables: TableView, keep_rows: np.ndarray,
             graph: int | None, previous: torch.Tensor | None) -> torch.Tensor:
        """The step's forward: the decode graph of size `graph`, else eagerly (`forward`)."""
        if graph is None:
            return self.forward(inputs, tables, keep_rows, self.kv_caches, previous)
        assert self.graphs is not None
        hidden = self.graphs.run(graph, inputs, self._decode_slots(inputs), previous)
        return _rows(hidden, keep_rows, self.link)

    def _send_step(self, inputs: StepInputs, tables: TableView, keep_rows: np.ndarray,
                   graph: int | None, previous: torch.Tensor | None) -> None:
        """The step to the tensor-parallel workers: its packed inputs in one broadcast, the
        graph it replays, and the tokens its placeholders stand for."""
        assert self.workers is not None
        width = max(1, -(-int((inputs.starts + inputs.num_new).max()) // self.block_size))
        self.workers.rank.channel.send_step(
            [inputs.starts, inputs.num_new, inputs.token_ids, keep_rows, inputs.pending_rows,
             inputs.pending_src, tables.host[tables.rows, :width]], graph or 0, previous)

    def serve_rank_zero(self) -> None:
        """A worker's loop: run each step (and each LM-head scan) rank 0 broadcasts, on this
        rank's shard, until rank 0 says stop. A step's sequences take rows 0..B-1 of this
        rank's own block table (a worker keeps no request), so a decode graph replays as
        rank 0's does."""
        assert self.rank is not None and self.workers is None
        channel = self.rank.channel
        none = np.zeros(0, dtype=np.int64)
        while True:
            with torch.inference_mode():
                command = channel.receive(self.head.input_dtype)
                if command.hidden is not None:
                    self.head.gather_logits(command.hidden)
                elif command.arrays:
                    starts, num_new, token_ids, keep_rows, pending_rows, pending_src, table = \
                        command.arrays
                    rows = self.tables.write_rows(table)
                    inputs = StepInputs(starts, num_new, token_ids, pending_rows, pending_src,
                                        StepRows(rows, none, none, none, none))
                    tables = TableView(self.tables.host, self.tables.device, rows)
                    self._run(inputs, tables, keep_rows, command.graph or None,
                              command.previous)
                elif command.asks_counts:
                    channel.answer_counts(self.graph_counts())
                else:
                    return

    def graph_counts_of_every_rank(self) -> list[GraphCounts]:
        """Rank 0's and each worker's `graph_counts` (rank 0's alone without workers)."""
        if self.workers is None:
            return [self.graph_counts()]
        return self.workers.rank.channel.ask_counts(self.graph_counts())

    @torch.inference_mode()
    def draft_forward(self, starts: np.ndarray, num_new: np.ndarray, token_ids: np.ndarray,
                      requests: list[Any], kv_caches: KVCaches) -> torch.Tensor:
        """The draft model's forward (drafter.py) over these requests' positions [starts[i],
        starts[i] + num_new[i]) (their slots allocated), its K/V into `kv_caches`: the final
        hidden states at each request's last row."""
        assert self.drafter is not None
        rows = self.tables.rows_for(requests)
        self.tables.sync(requests, rows, starts + num_new)
        meta, positions = self._metadata(starts, num_new,
                                         TableView(self.tables.host, self.tables.device, rows),
                                         kv_caches)
        ids, position_ids = self.link.upload_many([token_ids, positions], np.int64)
        hidden: torch.Tensor = self.drafter.decoder(ids, position_ids.int(), meta)
        if int(num_new.max()) == 1:
            return hidden
        return hidden.index_select(0, self.link.upload(np.cumsum(num_new) - 1))

    def _decode_slots(self, inputs: StepInputs) -> np.ndarray:
        starts, bs = inputs.starts, self.block_size
        return self.tables.host[inputs.rows.rows, starts // bs] * bs + starts % bs

    def note_sampled(self, rows: StepRows, tokens: np.ndarray,
                     shift: np.ndarray | None = None) -> None:
        """A step's sampled tokens, on the host now: the next decodes' inputs (each `shift`
        positions from the one sampled after the step's last: a request that verified drafts
        ends where its accepted ones did)."""
        self.tables.note_sampled(rows, tokens, shift)

    def note_placeholders(self, rows: StepRows) -> None:
        """A step's sampled tokens are still on the device (an overlapped step)."""
        self.tables.note_placeholders(rows)

    def release(self, preempted: list[Any]) -> None:
        """Preempted requests' block-table rows are free."""
        if preempted:
            self.tables.release(preempted)

    def forward(self, inputs: StepInputs, tables: TableView, keep_rows: np.ndarray,
                kv_caches: KVCaches, previous: torch.Tensor | None = None) -> torch.Tensor:
        """One packed forward, eagerly (see `execute`), its inputs uploaded in one copy."""
        meta, positions = self._metadata(inputs.starts, inputs.num_new, tables, kv_caches)
        every_row = _every_row(keep_rows, len(inputs.token_ids))
        input_ids, position_ids, keep, dst, src = self.link.upload_many(
            [np.maximum(inputs.token_ids, 0), positions, keep_rows[:0] if every_row else keep_rows,
             inputs.pending_rows, inputs.pending_src], np.int64)
        if len(inputs.pending_rows):
            assert previous is not None, "a placeholder with no step before it"
            input_ids.index_copy_(0, dst, previous.index_select(0, src))
        if self.pieces is not None:  # int32, as a decode graph's: one kernel specialization
            position_ids = position_ids.int()
        pieces = self.piecewise
        size = pieces.size_for(len(input_ids)) if pieces is not None else None
        # the first real batch sets the fp8 scales where --calculate-kv-scales asks
        calibrating = (self.kv_scales is not None and kv_caches is self.kv_caches
                       and self.kv_scales.arm())
        try:
            if size is None and self.pieces is not None and not every_row and self.lora is None:
                # Tandem's own model: the last layer finishes the kept rows only (not with
                # LoRA, whose step rows are every row's)
                kept: torch.Tensor = self.decoder(input_ids, position_ids, meta, keep)
                return kept
            hidden: torch.Tensor = (self.decoder(input_ids, position_ids, meta)
                                    if pieces is None or size is None
                                    else pieces.run(size, input_ids, position_ids, meta))
        finally:
            if calibrating:
                assert self.kv_scales is not None
                self.kv_scales.disarm()
        return hidden if every_row else hidden[keep]

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, num_seqs: int) -> StepMemory:
        """Measure (memory_profile.measure_step) a step of `num_tokens` prompt tokens over
        `num_seqs` sequences (at most, and none longer than the context), each then sampled the
        costliest way, on a stand-in KV cache just large enough (left out of the weights)."""
        seqs = max(min(num_seqs, num_tokens), -(-num_tokens // self.facts.max_model_len))
        num_new = np.full(seqs, num_tokens // seqs, dtype=np.int64)
        num_new[:num_tokens % seqs] += 1
        width = -(-int(num_new.max()) // self.block_size)
        table = np.arange(seqs * width, dtype=np.int64).reshape(seqs, width)
        caches = self._allocate_kv(seqs * width)
        scratch = sum(k.nbytes + v.nbytes for k, v in caches)
        sampler = DeviceSampler(self.head_weights, self.link)
        host = table.astype(np.int32)
        tables = TableView(host, self.link.upload(host), np.arange(seqs))
        none = np.zeros(0, dtype=np.int64)
        empty = StepRows(none, none, none, none, none)
        inputs = StepInputs(np.zeros(seqs, dtype=np.int64), num_new,
                            np.zeros(num_tokens, dtype=np.int64), none, none, empty)

        def step() -> None:
            hidden = self.forward(inputs, tables, np.cumsum(num_new) - 1, caches)
            sampler.profile(hidden)

        return measure_step(self.device, step, scratch)


def _every_row(keep: np.ndarray, rows: int) -> bool:
    """Whether `keep` is every one of `rows` rows, in order (a decode-only step's)."""
    return len(keep) == rows and (not rows or (keep[0] == 0 and keep[-1] == rows - 1
                                               and bool((np.diff(keep) == 1).all())))


def _rows(hidden: torch.Tensor, keep: np.ndarray, link: Any) -> torch.Tensor:
    """`hidden` at rows `keep` (all of them, in order, needs no gather)."""
    if _every_row(keep, len(hidden)):
        return hidden
    return hidden.index_select(0, link.upload(keep))


def _kv_scales(config: EngineConfig, hf_config: Any, layers: int, device: torch.device,
               tp: TensorParallel | None) -> fp8_kv.KVScales:
    """An fp8 cache's scales: the checkpoint's, else calculated from the first batch
    (--calculate-kv-scales, agreed between tensor-parallel ranks), else 1.0."""
    given = fp8_kv.checkpoint_scales(config.model, hf_config, layers)
    source = ("the checkpoint's" if given is not None else
              "the first batch's" if config.calculate_kv_scales else "1.0")
    log.info("fp8 KV cache (e4m3), scales per layer: %s", source)
    return fp8_kv.KVScales.build(layers, device, given, config.calculate_kv_scales,
                                   None if tp is None else tp.group, tp is not None)


def _dtype_name(dtype: torch.dtype) -> str:
    return "fp8 (e4m3)" if dtype == fp8_kv.FP8 else str(dtype).removeprefix("torch.")


def _kv_shape(text: Any, tp: TensorParallel | None = None) -> KVShape:
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if tp is not None:  # this rank's KV heads
        kv_heads = tp.heads(heads, kv_heads).kv_heads
    return KVShape(text.num_hidden_layers, kv_heads, head_dim)


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
                      sampling_defaults(config), int(getattr(text, "hidden_size", 0) or 0),
                      _matryoshka(text))


def _matryoshka(text: Any) -> tuple[int, ...] | None:
    """The widths a Matryoshka embedding model may be cut to, as vLLM reads its config
    (`matryoshka_dimensions`, or `is_matryoshka` for any width), or None."""
    dims = getattr(text, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(text, "is_matryoshka", False) else None


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
