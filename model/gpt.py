"""GPT-2++: a decoder-only transformer with RMSNorm, SwiGLU and rotary position embeddings.

The "GPT-2++" of Distributed Lion §5.2 and Lion Cub App. F.2: GPT-2 shapes with the LLaMA-era
changes (gated linear unit MLP, RMSNorm), no biases, no dropout. Parameter names are chosen so
that `param_roles` can find the layers the papers single out (token embedding, output head,
attention, MLP, norms): Lion Cub §5 synchronises the momenta of the embedding and the head.

Generation: `forward_cached` runs new tokens against a `KVCache` (one position of attention per
token); `generate` samples with it (greedy at temperature 0) and gives the tokens of the plain
forward pass. `logits` returns every position's logits for scoring; the training `forward` is
unchanged. The layout is Llama's, so model/hf.py maps it exactly to LlamaForCausalLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 1024
    """Maximum sequence length (context window)."""
    vocab_size: int = 50304
    """Vocabulary size; GPT-2's 50257 padded up to a multiple of 64 for fast matmuls."""
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention: n_head / n_kv_head query heads share one); 0 = n_head."""
    mlp_hidden: int = 0
    """SwiGLU hidden width; 0 = the multiple of 64 nearest to 8/3 * n_embd (same FLOPs as a 4x MLP)."""
    pos_emb: str = "rope"
    """"rope" (rotary, default) or "learned" (GPT-2's absolute position table)."""
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    """Share the token embedding and the output head weight (GPT-2, nanoGPT)."""
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        problems = []
        if self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        elif (self.n_embd // self.n_head) % 2 and self.pos_emb == "rope":
            problems.append(f"head size {self.n_embd // self.n_head} must be even for rotary embeddings")
        if self.pos_emb not in ("rope", "learned"):
            problems.append(f"pos_emb={self.pos_emb!r}; use 'rope' or 'learned'")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.n_kv_head < 0 or (self.n_kv_head and self.n_head % self.n_kv_head):
            problems.append(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (0 = n_head)")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.mlp_hidden <= 0:
            self.mlp_hidden = 64 * max(1, round(8 * self.n_embd / 3 / 64))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rotary_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd); rotate the two halves of each head (GPT-NeoX layout)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class KVCache:
    """Keys and values of the positions decoded so far, per layer: (B, n_head, max_len, head_dim)
    buffers filled left to right, so each new token costs one position of attention instead of a
    forward pass over the whole context. A layer's buffers are allocated at its first use, in the
    dtype its keys come in (e.g. bf16 under autocast)."""

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int) -> None:
        self.shape = (batch_size, n_head, max_len, head_dim)
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.max_len = max_len
        self.length = 0
        """Positions filled; the next token sits at position `length`."""

    def buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None or self.k[layer].dtype != like.dtype:
            self.k[layer] = torch.zeros(self.shape, device=like.device, dtype=like.dtype)
            self.v[layer] = torch.zeros(self.shape, device=like.device, dtype=like.dtype)
        return self.k[layer], self.v[layer]

    def reset(self) -> None:
        self.length = 0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # rows: the query heads, then the key heads, then the value heads (n_kv_head each)
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj.residual_scale = True

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                kv: tuple[KVCache, int] | None = None) -> torch.Tensor:
        """`rope`: the (cos, sin) rows of x's positions. `kv`: (cache, layer index) when decoding
        incrementally; x then holds positions cache.length .. cache.length + T - 1."""
        B, T, C = x.shape
        hd, kv_dim = self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([C, kv_dim, kv_dim], dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k, v = (t.view(B, T, self.n_kv_head, hd).transpose(1, 2) for t in (k, v))  # (B, n_kv, T, hd)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is None:
            k, v = self._repeat_kv(k), self._repeat_kv(v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            cache, layer = kv
            start = cache.length
            k_buf, v_buf = cache.buffers(layer, k)  # the cache holds the n_kv_head heads, unrepeated
            k_buf[:, :, start:start + T] = k
            v_buf[:, :, start:start + T] = v
            k, v = self._repeat_kv(k_buf[:, :, :start + T]), self._repeat_kv(v_buf[:, :, :start + T])
            if T == 1:  # one new query sees every cached position
                y = F.scaled_dot_product_attention(q, k, v)
            elif start == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # is_causal aligns the mask top-left; new query i sees keys 0..start+i
                keep = torch.arange(start + T, device=x.device)[None, :] <= \
                    torch.arange(start, start + T, device=x.device)[:, None]
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n_kv, T, hd) -> (B, nh, T, hd): query head i attends with key/value head i // (nh / n_kv)
        (Llama's repeat_kv layout, so the HF mapping needs no permutation)."""
        rep = self.n_head // self.n_kv_head
        return t if rep == 1 else t.repeat_interleave(rep, dim=1)


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 2 * cfg.mlp_hidden, bias=False)  # gate and value in one matmul
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=False)
        self.proj.residual_scale = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * value)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope, kv=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, kv)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            norm_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        if config.pos_emb == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.activation_checkpointing = False
        """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant) while
        training; the same gradients for less memory."""
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if config.pos_emb == "rope":
            cos, sin = rotary_tables(config.head_dim, config.block_size, config.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 init; residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper §2.3)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = residual_std if getattr(module, "residual_scale", False) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _embed(self, idx: torch.Tensor, start: int = 0):
        """Token (+ learned position) embeddings of positions start..start+T-1, and their RoPE rows."""
        T = idx.size(1)
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.pos_emb == "learned":
            return x + self.transformer.wpe(torch.arange(start, start + T, device=idx.device)), None
        return x, (self.rope_cos[start:start + T], self.rope_sin[start:start + T])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x, rope = self._embed(idx)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.transformer.h:
            x = checkpoint(block, x, rope, use_reentrant=False) if recompute else block(x, rope)
        x = self.transformer.norm_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # (B, 1, V): only the last position is needed
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits at every position, (B, T, V) (scoring: evaluation, log-likelihoods)."""
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds block_size {self.config.block_size}")
        x, rope = self._embed(idx)
        for block in self.transformer.h:
            x = block(x, rope)
        return self.lm_head(self.transformer.norm_f(x))

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty KV cache for `batch_size` sequences of up to `max_len` (default block_size) positions."""
        cfg = self.config
        return KVCache(cfg.n_layer, batch_size, cfg.n_kv_head, min(max_len or cfg.block_size, cfg.block_size),
                       cfg.head_dim)

    def forward_cached(self, idx: torch.Tensor, cache: KVCache, last_only: bool = True) -> torch.Tensor:
        """Run the new tokens idx (B, T) at positions cache.length.. and append their keys and
        values to `cache`. Returns the logits of the last position (B, 1, V), or of all T positions."""
        start, T = cache.length, idx.size(1)
        if start + T > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; {start} used + {T} new do not fit "
                             f"(reset it and re-run the last block_size tokens)")
        x, rope = self._embed(idx, start)
        for i, block in enumerate(self.transformer.h):
            x = block(x, rope, (cache, i))
        cache.length = start + T
        x = self.transformer.norm_f(x[:, [-1], :] if last_only else x)
        return self.lm_head(x)

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied weight counts once). non_embedding drops the token and
        position tables, and the head when it is a separate matrix (the Kaplan et al. convention)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 * N_matmul + attention scores
        (PaLM appendix B; nanoGPT's estimate_mfu)."""
        cfg = self.config
        T = seq_len or cfg.block_size
        n_matmul = self.num_params(non_embedding=True) + self.lm_head.weight.numel()
        return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.n_embd * T

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, *, use_cache: bool = True, generator: torch.Generator | None = None,
                 stop_token: int | None = None, vocab_limit: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
        """Append up to `max_new_tokens` sampled tokens to idx (B, T). temperature 0 = greedy
        (argmax); top_k keeps the k most likely tokens, top_p the most likely ones whose probabilities sum
        to top_p (nucleus sampling; after top_k when both are given); `generator` seeds the sampling; sampling stops
        once every row has produced `stop_token`; ids >= `vocab_limit` (the padded part of the
        vocabulary, which no tokenizer can decode) are never sampled. Past block_size tokens the
        context is the last block_size tokens (a sliding window); with the KV cache that window is
        re-run from scratch on every such token, so both paths give the same tokens."""
        block = self.config.block_size
        cache = self.new_cache(idx.size(0)) if use_cache else None
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for step in range(max_new_tokens):
            if cache is None:
                logits = self(idx[:, -block:])[0]
            elif step > 0 and cache.length < block:
                logits = self.forward_cached(idx[:, -1:], cache)
            else:  # first step, or the window is full: (re)fill the cache with the last block tokens
                cache.reset()
                logits = self.forward_cached(idx[:, -block:], cache)
            nxt = sample_next(logits[:, -1, :], temperature, top_k, generator, vocab_limit, top_p)
            if stop_token is not None:
                nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
                done |= nxt == stop_token
            idx = torch.cat((idx, nxt[:, None]), dim=1)
            if stop_token is not None and bool(done.all()):
                break
        return idx


def model_from_state_dict(config: GPTConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None) -> GPT:
    """A GPT of `config` holding exactly the tensors of `state` (strict names and shapes), built
    without a random initialisation; parameters keep their stored dtype unless `dtype` is given."""
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device=device)
    if config.pos_emb == "rope":  # non-persistent buffers are in no state dict: rebuild them
        cos, sin = rotary_tables(config.head_dim, config.block_size, config.rope_base)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    state = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:  # assign=True gives the head its own Parameter object: share it again
        model.lm_head.weight = model.transformer.wte.weight
    return model


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None, vocab_limit: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """One token id per row of logits (B, V): argmax for temperature <= 0, else a draw from
    softmax(logits / temperature) restricted to the top_k largest, then to the nucleus: the fewest
    most likely tokens whose probability sums to at least top_p (Holtzman et al., "The Curious Case
    of Neural Text Degeneration", §3.1; the most likely token always stays)."""
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits = logits.clone()
        logits[:, vocab_limit:] = -float("inf")
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and 0 < top_p < 1:
        probs, order = torch.sort(F.softmax(logits, dim=-1), dim=-1, descending=True)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), -float("inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


def estimate_mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
    return flops_per_token * tokens_per_s / peak_flops


ROLES = ("embedding", "head", "attn", "mlp", "norm")
IO_ROLES = ("embedding", "head")  # the input and output layers (Lion Cub §5 syncs their momentum)
MATRIX_ROLES = ("attn", "mlp")  # the hidden matrices (what Muon and Dion orthonormalize)


def param_roles(model: nn.Module) -> dict[str, str]:
    """Map each parameter name to the role the papers single out: embedding, head, attn, mlp,
    norm (1-D scalars). A tied embedding/head weight appears once, as "embedding"."""
    roles = {}
    for name, p in model.named_parameters():  # named_parameters yields a shared weight once
        if name.startswith("transformer.wte.") or name.startswith("transformer.wpe."):
            role = "embedding"
        elif name.startswith("lm_head."):
            role = "head"
        elif p.ndim < 2:
            role = "norm"
        elif ".attn." in name:
            role = "attn"
        elif ".mlp." in name:
            role = "mlp"
        else:
            raise ValueError(f"parameter {name} has no role; extend model.param_roles")
        roles[name] = role
    return roles


def param_layers(model: nn.Module) -> dict[str, str]:
    """Map each parameter name to its transformer block, "block.<i>", or "" outside the blocks
    (embedding, head, final norm), for per-layer diagnostics (Lion Cub Fig. 6, 17)."""
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        out[name] = f"block.{parts[2]}" if parts[:2] == ["transformer", "h"] and len(parts) > 2 else ""
    return out
