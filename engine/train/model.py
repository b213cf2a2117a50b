"""A small byte-level GPT built from engine modules - the whole model in one page.

Each block is attention (LayerNormLinear for QKV, torch's scaled_dot_product_attention,
Linear for the output projection) and an MLP (LayerNormMLP; with `moe_experts`, a LayerNorm and an
engine.moe.MoEMLP of that many experts, `moe_top_k` per token), both with residuals. The
embeddings, final norm and LM head stay in high precision, as is usual for FP8 training.
Parameters are fp32 (master weights); activations run in bf16 or fp32 (`activation_dtype`: the demo picks
the one the machine's GEMMs are fast at). For decoding, `forward`
takes a `KVCache`: it reads the positions after the cached ones and appends their keys and
values. Positions are learned up to seq_len, so a longer sequence is refused (no sliding window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

import engine

VOCAB_SIZE = 256  # bytes


class GPTConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    d_model: int = Field(128, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=2)
    ffn_mult: int = Field(4, ge=1)
    moe_experts: int = Field(0, ge=0)  # 0: dense MLPs; else experts per MoE MLP
    moe_top_k: int = Field(2, ge=1)  # experts per token

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) must be at most moe_experts ({self.moe_experts})")
        return self


class LayerKV:
    """One block's cached keys and values: [batch, heads, capacity, head_dim] buffers, made at first use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, heads, new, head_dim] at positions start..; the keys and values of all positions so far."""
        end = start + k.shape[2]
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:2], self.capacity, k.shape[3])
            self.v = torch.zeros_like(self.k)
        elif self.k.shape[:2] != k.shape[:2]:
            raise ValueError(f"cache: made for [batch, heads] = {list(self.k.shape[:2])}, got {list(k.shape[:2])}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every block for the first `length` positions (at most the model's seq_len)."""

    def __init__(self, cfg: GPTConfig) -> None:
        self.layers = [LayerKV(cfg.seq_len) for _ in range(cfg.n_layers)]
        self.length = 0


class Attention(torch.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = engine.LayerNormLinear(cfg.d_model, 3 * cfg.d_model)
        self.proj = engine.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None, start: int = 0) -> torch.Tensor:
        """x holds positions start..start+seq; with `kv`, they attend to the cached positions before them too."""
        batch, seq, width = x.shape
        # heads-major [head, q|k|v, head_dim]: a column-parallel shard of qkv holds whole heads
        qkv = self.qkv(x)
        q, k, v = qkv.view(batch, seq, -1, 3, width // self.n_heads).permute(3, 0, 2, 1, 4)
        if kv is not None:
            k, v = kv.extend(k, v, start)
        if start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif seq == 1:  # one new position sees every cached one
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # query i (position start + i) sees keys 0..start + i
            mask = torch.ones(seq, start + seq, dtype=torch.bool, device=x.device).tril(start)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MoEFeedForward(torch.nn.Module):
    """LayerNorm (fp32) then a mixture of experts (engine.moe.MoEMLP: fp32 router, engine.GroupedLinear experts)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(cfg.d_model)
        self.moe = engine.moe.MoEMLP(cfg.d_model, cfg.ffn_mult * cfg.d_model, cfg.moe_experts, cfg.moe_top_k,
                                     activation="gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm  # in fp32 even when the block was cast to bf16 (as `engine generate` casts it)
        normed = F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)
        return self.moe(normed.to(x.dtype))


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MoEFeedForward(cfg) if cfg.moe_experts else \
            engine.LayerNormMLP(cfg.d_model, cfg.ffn_mult * cfg.d_model, activation="gelu")

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None, start: int = 0) -> torch.Tensor:
        x = x + self.attn(x, kv, start)
        return x + self.mlp(x)


class GPT(torch.nn.Module):
    def __init__(self, cfg: GPTConfig, *, high_precision_last_blocks: int = 0,
                 activation_dtype: torch.dtype = torch.bfloat16) -> None:
        """`high_precision_last_blocks`: the last blocks run unquantized inside fp8_autocast (as TE advises for
        NVFP4); `activation_dtype`: bf16 or fp32 between the embeddings and the final norm."""
        super().__init__()
        if activation_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"activation_dtype: expected torch.bfloat16 or torch.float32, got {activation_dtype}")
        self.cfg = cfg
        self.activation_dtype = activation_dtype
        self.high_precision_last_blocks = high_precision_last_blocks
        self.tok_emb = torch.nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos_emb = torch.nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = torch.nn.LayerNorm(cfg.d_model)
        self.head = torch.nn.Linear(cfg.d_model, VOCAB_SIZE, bias=False)
        for emb in (self.tok_emb, self.pos_emb):
            torch.nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (fp32) for every position of a [batch, seq] byte tensor; with `cache`, the tokens follow
        the cache.length cached positions, and their keys and values are added to the cache."""
        start = 0 if cache is None else cache.length
        end = start + tokens.shape[1]
        if end > self.cfg.seq_len:
            raise ValueError(f"tokens: positions {start}..{end - 1} go past the last learned position "
                             f"{self.cfg.seq_len - 1} (seq_len {self.cfg.seq_len}; no sliding window)")
        positions = torch.arange(start, end, device=tokens.device)
        x = (self.tok_emb(tokens) + self.pos_emb(positions)).to(self.activation_dtype)
        first_bf16 = len(self.blocks) - self.high_precision_last_blocks
        for i, block in enumerate(self.blocks):
            kv = None if cache is None else cache.layers[i]
            if i >= first_bf16:
                with engine.fp8_autocast(enabled=False):
                    x = block(x, kv, start)
            else:
                x = block(x, kv, start)
        if cache is not None:
            cache.length = end
        return self.head(self.norm(x.float()))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte cross-entropy over a [batch, seq + 1] window (plus the MoE blocks' load-balancing losses)."""
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
        for block in self.blocks:
            if isinstance(block.mlp, MoEFeedForward):
                loss = loss + block.mlp.moe.aux_loss
        return loss
