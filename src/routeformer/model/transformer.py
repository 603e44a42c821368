"""TransformerLM: token embedding, (positions), blocks of mixed-head attention, final norm, logits."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..attention.kinds import HeadGroup
from ..documents import DocumentSpans, check_documents, continue_documents
from ..executors import get_executor
from .config import TransformerConfig
from .generate import generate, stream
from .layers import Block, LayerCache, init_weights
from .positions import PositionEmbedding
from .pretrained import from_pretrained, save_pretrained
from .tokens import check_model_tokens


class ModelCache:
    """Decoding state of every layer (``LayerCache``: one cache per head group). The positions seen (``length``)
    and the declared maximum (``max_len``) live here only: the model checks them once per forward and passes the
    start position down to every layer."""

    def __init__(self, layers: list[LayerCache], max_len: int) -> None:
        self.layers, self.max_len, self.length = layers, max_len, 0
        self.documents: DocumentSpans | None = None  # the last forward's, once a forward gave documents

    def check(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"max_len: {self.length + n} positions exceed the cache's declared max_len={self.max_len}")


class TransformerLM(nn.Module):
    """An autoregressive Transformer whose heads mix attention mechanisms (see ``TransformerConfig``).

    ``model(tokens)`` maps (B, N) integer tokens to (B, N, vocab_size) logits and leaves the head groups'
    auxiliary loss (routing heads: the commitment loss) in ``model.aux_loss`` (a scalar tensor; add it to the
    training loss; ``model.commitment_loss`` is the same tensor). ``model.after_optimizer_step()`` runs the head
    groups' per-step hooks (routing: the k-means step): call it after each ``optimizer.step()``.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise ValueError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = config
        d = config.dim
        self.embed = nn.Embedding(config.vocab_size, d)
        self.positions = PositionEmbedding(config) if config.positions in ("absolute", "factorized") else None
        self.blocks = nn.ModuleList(Block(config, spec, i) for i, spec in enumerate(config.head_groups()))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        # The Sparse Transformer's initialisation.
        nn.init.normal_(self.embed.weight, std=0.125 / math.sqrt(d))
        for block in self.blocks:
            init_weights(block, config.depth)
        nn.init.zeros_(self.head.weight)
        self.aux_loss: Tensor = torch.zeros(())
        self._executor_device: torch.device | None = None
        # A named executor is bound now (resolving a name builds nothing), and again at a forward on another device.
        # "auto" waits for the first forward's device: resolved for the CPU here it would compile the CPU kernels
        # (25-60 s) for a model about to move to CUDA; until then a head group's executor is "auto" on its device.
        if config.backend != "auto":
            self._bind_executors(torch.device("cpu"))

    def _bind_executors(self, device: torch.device) -> None:
        """Resolve ``config.backend`` for ``device`` once ("auto": the fused kernels on the CPU, FlexAttention on
        CUDA; only the CPU's builds the kernels) and hand the executor to every head group that runs on one, and
        to the feed-forward layers (their activation's kernel)."""
        executor = get_executor(self.config.backend, device)
        for block in self.blocks:
            block.attention.bind(executor)
            block.ff.executor = executor
        self._executor_device = device

    @property
    def commitment_loss(self) -> Tensor:
        """The auxiliary loss of the last forward (``aux_loss``), by the name the routing paper gives it."""
        return self.aux_loss

    def forward(self, tokens: Tensor, cache: ModelCache | None = None, *, documents: Tensor | None = None) -> Tensor:
        """(B, N) tokens -> (B, N, vocab_size) logits. With ``cache`` the tokens continue the cached sequence.
        ``documents`` (B, N) integer ids that never decrease along a row (``routeformer.documents`` makes them):
        packed documents, each scored as if alone (attention, the token shift and absolute positions stop at every
        boundary; kinds that cannot honour them are refused by name). With a cache they continue the row's ids: a
        prompt of several documents, or a row that begins a new document at any position while the others go on;
        once given, a forward without them continues each row's last document."""
        self._check_tokens(tokens)
        B, N = tokens.shape
        start, spans, cache_spans = 0, None, None
        if cache is not None:
            cache.check(N)
            start = cache.length
            if documents is not None or cache.documents is not None:
                ids = documents if documents is not None else cache.documents.last[:, None].expand(B, N)
                cache_spans = continue_documents(ids, B, N, tokens.device, start, cache.documents)
                spans = cache_spans if cache_spans.crosses else None  # else one document a row: the plain path
            documents = None
        else:
            documents = check_documents(documents, B, N, tokens.device)
        if tokens.device != self._executor_device:  # the model moved: its device's executor
            self._bind_executors(tokens.device)
        x = self.embed(tokens)
        if self.positions is not None:
            x = x + self.positions(start, N, tokens.device, documents,
                                   None if spans is None else spans.since).to(x.dtype)
        aux: Tensor | None = None
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x, loss = block(x, cache.layers[i], start) if spans is None else \
                    block(x, cache.layers[i], start, None, spans)
            elif self.config.checkpointing and self.training:
                x, loss = checkpoint(block, x, None, 0, documents, use_reentrant=False)
            else:
                x, loss = block(x) if documents is None else block(x, None, 0, documents)
            if loss is not None:
                aux = loss if aux is None else aux + loss
        if cache is not None:
            cache.length = start + N
            if cache_spans is not None:
                cache.documents = cache_spans
        self.aux_loss = aux if aux is not None else x.new_zeros(())
        return self.head(self.norm(x))

    def _check_tokens(self, tokens: Tensor) -> None:
        check_model_tokens(tokens, self.config.vocab_size)

    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, documents: Tensor | None = None) -> Tensor:
        """prompt (B, N) or (N,) -> (B, N + max_new_tokens), with every mechanism's decoding cache (see
        ``generate.py`` for what happens past ``seq_len``). temperature 0 is greedy; seed makes it repeatable.
        ``documents``: the prompt's packed documents (as ``forward`` takes them); each row's last goes on."""
        return generate(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, documents)

    def stream(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               documents: Tensor | None = None) -> Iterator[Tensor]:
        """Like ``generate``, yielding each new position's tokens (B,) as soon as it is sampled."""
        return stream(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, documents)

    def save_pretrained(self, directory: str | Path) -> None:
        """model.safetensors (weights, routing centroids and projections) and config.json, written atomically."""
        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu") -> TransformerLM:
        """The model saved by ``save_pretrained``; errors name the file and what is wrong with it."""
        return from_pretrained(cls, directory, map_location)

    def head_groups(self) -> list[HeadGroup]:
        """Every layer's head groups, in order."""
        return [g for block in self.blocks for g in block.attention.groups]

    def after_optimizer_step(self, step: int | None = None, group: dist.ProcessGroup | None = None) -> int:
        """Run every head group's per-step hook (routing: the k-means step, all-reduced across the ranks of
        ``group``); call it after each ``optimizer.step()`` on every rank. Returns how many groups had one."""
        return sum(bool(g.after_optimizer_step(step, group)) for g in self.head_groups())

    def replicated_state(self) -> dict[str, Tensor]:
        """Every buffer the ranks of a parallel run must hold bit-identical (each head group's
        ``replicated_state``: routing's k-means state), by its name in ``named_buffers``."""
        return {f"{name}.{key}": buf for name, module in self.named_modules() if isinstance(module, HeadGroup)
                for key, buf in module.replicated_state().items()}

    def new_cache(self, batch: int, max_len: int) -> ModelCache:
        """An empty decoding cache for up to ``max_len`` positions."""
        p = next(self.parameters())
        return ModelCache([block.attention.new_cache(batch, max_len, p.device, p.dtype) for block in self.blocks],
                          max_len)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Trainable parameters (without the token and position embeddings if asked)."""
        total = sum(p.numel() for p in self.parameters() if p.requires_grad)
        if exclude_embeddings:
            total -= self.embed.weight.numel()
            if self.positions is not None:
                total -= sum(p.numel() for p in self.positions.parameters())
        return total

    def flops_per_token(self, seq_len: int | None = None, training: bool = True, step: int | None = None) -> float:
        """Estimated FLOPs per token: 2 per weight multiply-add, plus attention's q·k and p·v over the keys each
        mechanism visits at context ``seq_len`` (default the config's) and optimiser step ``step`` (None: after any
        warm-up, such as routing's dense one); ×3 for forward + backward."""
        c = self.config
        dense = 2 * self.num_parameters(exclude_embeddings=True)
        n = seq_len or c.seq_len
        attention = sum(4 * c.head_dim * g.kind.cost(g.options, n, step) * g.heads
                        for layer in c.head_groups() for g in layer)
        return (dense + attention) * (3 if training else 1)

    def training_flops(self, steps: int, tokens_per_step: int, *, short_steps: int = 0, short_len: int = 0) -> float:
        """Estimated FLOPs of ``steps`` optimiser steps of ``tokens_per_step`` tokens each, warm-ups included (at
        the length each trains at, ``TransformerConfig.train_len``), and the trainer's length warm-up: the first
        ``short_steps`` steps in rows of at most ``short_len`` tokens (``TrainConfig.short_steps`` / ``short_len``)."""
        ends = {*(e for e in self.config.cost_changes() if e < steps), steps}
        if 0 < short_steps < steps:
            ends.add(short_steps)
        total, done = 0.0, 0
        for end in sorted(ends):
            n = self.config.train_len(done)
            if done < short_steps:
                n = min(n, short_len)
            total += (end - done) * tokens_per_step * self.flops_per_token(n, step=done)
            done = end
        return total
