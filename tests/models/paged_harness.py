"""Drive an ingot model directly over a paged KV cache: prefill (optionally in chunks and beside
other requests) then teacher-forced decode steps, returning the logits of every step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from ingot.engine.arg_utils import EngineArgs
from ingot.model_executor.binding import bind, select_kernels
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.attention_backend import TORCH_ATTENTION
from ingot.model_executor.loader.model_loader import load_model
from ingot.model_executor.models.llama import head_dim_of


class PagedHarness:
    def __init__(self, model_dir: Path | str, block_size: int = 4, num_blocks: int = 64, **args: Any):
        config = EngineArgs(
            model=str(model_dir), dtype="float32", skip_tokenizer_init=True, block_size=block_size, **args
        ).create_engine_config()
        self.hf_config = config.model_config.hf_config
        cpu = torch.device("cpu")
        self.model = load_model(config.model_config, cpu)
        bind(self.model, TORCH_ATTENTION,
             select_kernels(self.model, config.model_config.dtype, cpu))
        hf = self.hf_config
        # This rank's KV heads (all of them without tensor parallelism).
        kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        shape = (2, num_blocks, block_size, kv_heads, head_dim_of(hf))
        self.kv = [torch.zeros(shape) for _ in range(hf.num_hidden_layers)]
        self.block_size = block_size
        # Hand blocks out in a shuffled order so requests own non-contiguous blocks.
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}

    def _ensure_blocks(self, req: int, num_tokens: int) -> list[int]:
        blocks = self.blocks.setdefault(req, [])
        while len(blocks) * self.block_size < num_tokens:
            blocks.append(self.free.pop())
        return blocks

    @torch.inference_mode()
    def step(self, batch: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """batch: (request key, token ids, start position). Returns logits [n_i, V] per request."""
        bs = self.block_size
        input_ids, positions, slots, query_lens = [], [], [], []
        tables = []
        for req, tokens, start in batch:
            blocks = self._ensure_blocks(req, start + len(tokens))
            tables.append(blocks)
            for i, t in enumerate(tokens):
                p = start + i
                input_ids.append(t)
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            query_lens.append(len(tokens))
        width = max(len(t) for t in tables)
        block_table = torch.zeros(len(batch), width, dtype=torch.int64)
        for row, t in enumerate(tables):
            block_table[row, : len(t)] = torch.tensor(t)
        pos = torch.tensor(positions)
        meta = AttentionMetadata.build(pos, query_lens, torch.tensor(slots), block_table,
                                       is_decode=max(query_lens) == 1)
        hidden = self.model(torch.tensor(input_ids), pos, self.kv, meta)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation that ignores EOS (like ignore_eos=True), through HF's KV cache
    (``cache=``, the pinned transformers' keyword; ``past_key_values`` is deprecated there).
    The cache's length is checked at every step: a keyword a later release ignored would drop
    the cache and fail here, not feed one token without its context (that happened on 5.17,
    which is why this once recomputed the whole sequence per token: 2.7x slower on the
    default model, the same tokens). (generate()'s min_new_tokens would instead forbid EOS, a
    different distribution.) Only the last position goes through the LM head."""
    tokens: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        for i in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == n:
                break
            cache = out.cache
            assert cache is not None and cache.get_seq_length() == len(prompt) + i, \
                "HF's KV cache was dropped or misread (a transformers API change?)"
            out = hf_model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True,
                           logits_to_keep=1)
    return tokens
