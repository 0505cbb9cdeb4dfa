"""Autoregressive generation with a KV cache, for looking at what a checkpoint has learned.

The prompt runs through the model once (prefill), then one token at a time, each block's keys and values
kept in a cache so that a step costs one token's compute. The blocks are run here from the model's public
pieces (`tok_embeddings`, each block's norms, `attention.wq/wk/wv/wo` and `feed_forward`, `norm`,
`output`, and the RoPE helpers), so the training forward stays as it is. Greedy decoding, or sampling
with a temperature and top-p (nucleus) from a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanrush.models.llama.model import Attention, Llama, apply_rope, rope_cache


@dataclass
class KVCache:
    """Keys and values of every block for the positions seen so far: (B, max_len, kv heads, head dim)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, model: Llama, batch: int, max_len: int) -> KVCache:
        """A cache for up to max_len positions, in the model's dtype and on its device."""
        a, w = model.args, model.tok_embeddings.weight
        shape = (batch, max_len, a.kv_heads, a.head_dim)
        keys = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(a.n_layers)]
        return cls(keys, [torch.zeros_like(k) for k in keys])


def _attend(
    attn: Attention, x: torch.Tensor, rope: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
) -> torch.Tensor:
    """One block's attention over the cache for the new positions start.. (x: (B, T, dim))."""
    bsz, seq, _ = x.shape
    q = attn.wq(x).view(bsz, seq, -1, attn.head_dim)  # (B, T, H, D)
    k = attn.wk(x).view(bsz, seq, -1, attn.head_dim)  # (B, T, Hkv, D)
    v = attn.wv(x).view(bsz, seq, -1, attn.head_dim)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    end = start + seq
    keys[:, start:end], values[:, start:end] = k, v
    q = q.transpose(1, 2)  # (B, H, T, D)
    k_all, v_all = keys[:, :end].transpose(1, 2), values[:, :end].transpose(1, 2)  # (B, Hkv, S, D)
    groups = q.shape[1] // k_all.shape[1]
    k_all, v_all = k_all.repeat_interleave(groups, dim=1), v_all.repeat_interleave(groups, dim=1)
    # New token i sits at position start + i and sees every cached position up to its own.
    mask = torch.ones(seq, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # (B, H, T, D)
    return attn.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def forward_cached(model: Llama, tokens: torch.Tensor, cache: KVCache, rope: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) of tokens (B, T), which follow the cache's positions; the cache grows by T."""
    start, seq = cache.length, tokens.shape[1]
    h = model.tok_embeddings(tokens)
    r = rope[start : start + seq]
    for i, block in enumerate(model.layers.values()):
        h = h + _attend(block.attention, block.attention_norm(h), r, cache.keys[i], cache.values[i], start)
        h = h + block.feed_forward(block.ffn_norm(h))
    cache.length += seq
    return model.output(model.norm(h))


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, vocab): argmax at temperature 0, else sampled from the
    smallest set of tokens whose probability reaches top_p."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens before it already reach top_p (the most likely one always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Llama,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The token ids that follow prompt, until eos_id (included) or max_new_tokens.

    Args:
        model: a whole Llama (embedding, blocks, norm, output) in eval mode on one device.
        prompt: token ids, at least one.
        max_new_tokens: the most tokens to generate.
        temperature: 0 for greedy decoding; above 0 the logits are divided by it and sampled.
        top_p: sample only from the most likely tokens whose probabilities add up to top_p (1: all).
        eos_id: stop after generating this id.
        seed: seeds the sampling generator (the same seed gives the same text).
    """
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token (e.g. BOS)")
    device = model.tok_embeddings.weight.device
    total = len(prompt) + max_new_tokens
    rope = rope_cache(model.args, total).to(device)
    cache = KVCache.empty(model, 1, total)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache, rope)[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_p, generator)
        out.append(int(token))
        if out[-1] == eos_id or len(out) == max_new_tokens:
            break
        logits = forward_cached(model, token[:, None], cache, rope)[:, -1]
    return out
