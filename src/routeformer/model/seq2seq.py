"""Seq2SeqLM: an encoder of non-causal mixed heads over a source, a decoder of causal mixed heads and cross-attention
heads that read the encoder's output (the memory), one shared byte embedding, logits over the target.

The encoder's layers are ``Block``s built non-causal (``HeadKind.encoder``: full, local, routing with the paper's
balanced clusters, linear, Performer), taking the source's padding; the decoder's are a causal ``MixedAttention``,
then a ``CrossAttention`` of its own spec of cross kinds (``attention/cross.py``: full, routing, MoBA, Performer,
linear), then the feed-forward, each pre-norm with its residual. Nothing a target position reads depends on a later
target position: the self-attention is causal, and no cross kind balances or ranks over the queries.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..attention.cross import CROSS, get_cross_kind
from ..checks import positive_int
from ..documents import CrossDocuments, check_cross_documents, check_documents
from ..executors import get_executor
from ..executors.inputs import Inputs
from .beam import beam_search, reorder_rows
from .config import TransformerConfig, parse_attention, read_json_object
from .generate import sample_next
from .layers import Block, FeedForward, LayerCache, MixedAttention, init_weights
from .positions import PositionEmbedding
from .pretrained import from_pretrained, save_pretrained
from .tokens import check_model_tokens


@dataclass
class Seq2SeqConfig:
    """An encoder-decoder model: ``encoder`` and ``decoder`` are ``TransformerConfig`` values (their seq_len the
    source's and the target's longest length; their depth, attention spec, options and positions their own; vocab,
    dim, heads and head_dim shared), ``cross`` the decoder's cross-attention spec over its heads ('routing:2,full:2'
    or one kind for every head) and ``cross_options`` each cross kind's section ({'routing': {'num_clusters': 16}}).
    A mapping for either stack is read as its ``TransformerConfig`` fields."""

    encoder: TransformerConfig | dict
    decoder: TransformerConfig | dict
    cross: str = "full"
    cross_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("encoder", "decoder"):
            value = getattr(self, name)
            if isinstance(value, dict):
                try:
                    value = TransformerConfig(**value)
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{name}: {err}") from None
            if not isinstance(value, TransformerConfig):
                raise ValueError(f"{name} must be a TransformerConfig or a table of its fields, got {value!r}")
            setattr(self, name, value)
        enc, dec = self.encoder, self.decoder
        for shared in ("vocab_size", "dim", "heads", "head_dim"):
            if getattr(enc, shared) != getattr(dec, shared):
                raise ValueError(f"encoder.{shared} ({getattr(enc, shared)}) and decoder.{shared} "
                                 f"({getattr(dec, shared)}) must be equal: one embedding, and cross heads of the "
                                 f"decoder's size over the encoder's output")
        if not isinstance(self.cross_options, dict):
            raise ValueError(f"cross_options must be a table of sections ({', '.join(CROSS)}), got "
                             f"{self.cross_options!r}")
        unknown = sorted(set(self.cross_options) - set(CROSS))
        if unknown:
            raise ValueError(f"cross_options: unknown section(s) {unknown}; cross kinds: {', '.join(CROSS)}")
        used = {name for name, _ in self.cross_spec()}
        self.cross_options = {name: get_cross_kind(name).read_options(self.cross_options.get(name))
                              for name in sorted(used | set(self.cross_options))}

    def to_dict(self) -> dict:
        """The fields as plain values (config.json): each stack's ``TransformerConfig.to_dict``."""
        return {"encoder": self.encoder.to_dict(), "decoder": self.decoder.to_dict(), "cross": self.cross,
                "cross_options": {k: None if o is None else asdict(o) for k, o in self.cross_options.items()}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Seq2SeqConfig:
        """The config ``save`` wrote; errors name the file."""
        data = read_json_object(path)
        if set(data) - {"encoder", "decoder", "cross", "cross_options"} or not {"encoder", "decoder"} <= set(data):
            raise ValueError(f"{path}: not an encoder-decoder config (encoder, decoder, cross, cross_options)")
        try:
            enc, dec = (TransformerConfig.from_dict(data[k], saved=True) for k in ("encoder", "decoder"))
            options = {k: v for k, v in data.get("cross_options", {}).items() if v is not None}
            return cls(enc, dec, data.get("cross", "full"), options)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

    def cross_spec(self) -> list[tuple[str, int]]:
        """The decoder's cross heads: (cross kind, heads) per group, the same in every layer."""
        spec = parse_attention(self.cross, self.decoder.heads, "cross")
        for name, _ in spec:
            get_cross_kind(name)  # a self-attention kind without a cross form: named, with those there are
        return spec


class CrossAttention(nn.Module):
    """Cross-attention heads split among cross kinds: queries from the decoder's x (B, Nt, dim), keys and values from
    the memory (B, Ns, dim) with its padding (B, Ns) -> ((B, Nt, dim), the groups' auxiliary loss or None)."""

    def __init__(self, config: Seq2SeqConfig, layer: int) -> None:
        super().__init__()
        dec = config.decoder
        H, D = dec.heads, dec.head_dim
        self.heads, self.head_dim = H, D
        self.query = nn.Linear(dec.dim, H * D)
        self.key = nn.Linear(dec.dim, H * D)
        self.value = nn.Linear(dec.dim, H * D)
        self.out = nn.Linear(H * D, dec.dim)
        self.sizes = [n for _, n in config.cross_spec()]
        self.groups = nn.ModuleList(
            get_cross_kind(name).build(config.cross_options[name], n, D, config.encoder.seq_len, layer * 131 + i)
            for i, (name, n) in enumerate(config.cross_spec()))

    def _heads(self, layer: nn.Linear, x: Tensor) -> tuple[Tensor, ...]:
        """x (B, N, dim) projected by ``layer`` and cut per group: (B, h, N, D) each."""
        B, N, _ = x.shape
        return layer(x).view(B, N, self.heads, self.head_dim).transpose(1, 2).split(self.sizes, 1)

    def forward(self, x: Tensor, memory: Tensor, memory_padding: Tensor | None = None,
                documents: CrossDocuments | None = None) -> tuple[Tensor, Tensor | None]:
        outs, aux = [], None
        for group, qg, kg, vg in zip(self.groups, self._heads(self.query, x), self._heads(self.key, memory),
                                     self._heads(self.value, memory), strict=True):
            outs.append(group(Inputs.cross(qg, kg, vg, key_padding_mask=memory_padding, documents=documents)))
            loss = group.aux_loss()
            if loss is not None:
                aux = loss if aux is None else aux + loss
        return self._out(outs), aux

    def _out(self, outs: list[Tensor]) -> Tensor:
        out = torch.cat(outs, 1)  # (B, H, N, D)
        B, _, N, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(B, N, self.heads * self.head_dim))

    def remember(self, memory: Tensor, memory_padding: Tensor | None = None) -> CrossMemory:
        """What decoding keeps of the memory (B, Ns, dim), once: each group's keys and values and what it prepares
        (routing: the keys' clusters and sort)."""
        ks, vs = self._heads(self.key, memory), self._heads(self.value, memory)
        prepared = [g.prepare(k, v, memory_padding) for g, k, v in zip(self.groups, ks, vs, strict=True)]
        return CrossMemory(list(ks), list(vs), memory_padding, prepared)

    def decode(self, x: Tensor, kept: CrossMemory) -> Tensor:
        """New decoder positions x (B, n, dim) over the remembered memory: the forward's rows."""
        outs = [g.decode(Inputs.cross(q, k, v, key_padding_mask=kept.padding), p) for g, q, k, v, p in
                zip(self.groups, self._heads(self.query, x), kept.keys, kept.values, kept.prepared, strict=True)]
        return self._out(outs)


@dataclass
class CrossMemory:
    """One decoder layer's memory for decoding: each cross group's keys and values (B, h, Ns, D), the memory's
    padding (B, Ns) or None, and what each group prepared (``CrossAttention.remember``)."""

    keys: list[Tensor]
    values: list[Tensor]
    padding: Tensor | None
    prepared: list[Any]


class DecoderBlock(nn.Module):
    """x + self(norm(x)), then + cross(norm(x), memory), then + ff(norm(x)) (pre-norm, dropout on each branch)."""

    def __init__(self, config: Seq2SeqConfig, spec: list, layer: int) -> None:
        super().__init__()
        dec = config.decoder
        self.norm1 = nn.LayerNorm(dec.dim)
        self.attention = MixedAttention(dec, spec, layer)
        self.norm_cross = nn.LayerNorm(dec.dim)
        self.cross = CrossAttention(config, layer)
        self.norm2 = nn.LayerNorm(dec.dim)
        self.ff = FeedForward(dec)
        self.dropout = nn.Dropout(dec.dropout)

    def forward(self, x: Tensor, memory: Tensor, memory_padding: Tensor | None,
                documents: CrossDocuments | None = None) -> tuple[Tensor, Tensor | None]:
        a, aux = self.attention(self.norm1(x), None, 0, None if documents is None else documents.queries)
        x = x + self.dropout(a)
        c, cross_aux = self.cross(self.norm_cross(x), memory, memory_padding, documents)
        x = x + self.dropout(c)
        aux = cross_aux if aux is None else aux if cross_aux is None else aux + cross_aux
        return x + self.dropout(self.ff(self.norm2(x))), aux

    def decode(self, x: Tensor, cache: LayerCache, start: int, kept: CrossMemory) -> Tensor:
        """New positions x (B, n, dim) from ``start`` on: the self-attention's cache, the remembered memory."""
        x = x + self.attention(self.norm1(x), cache, start)[0]
        x = x + self.cross.decode(self.norm_cross(x), kept)
        return x + self.ff(self.norm2(x))


@dataclass(frozen=True)
class Sampling:
    """How ``Seq2SeqLM.translate`` draws each token: at ``temperature`` (0: greedy), among the ``top_k`` most likely
    or the smallest set of probability ``top_p``, repeatably with ``seed``."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


INIT_GAIN = 8.0  # every weight matrix and embedding at 8 times the Sparse Transformer's scale (TransformerLM's), so
# N(0, 1/sqrt(fan-in)); the output head still starts at zero. Measured on copying random letters (dim 64, one layer
# each, full cross heads, batch 32, AdamW 2e-3; 2026-12-07): at the Sparse Transformer's scale the loss stayed at
# 3.1 nats after 600 steps (attention logits start near zero and grow slowly), at 8 times it reached 0.05 (0.004
# with the shared position table) by step 500; the embeddings alone or the linear layers alone at 8 times: 3.1.


class Seq2SeqLM(nn.Module):
    """An encoder-decoder Transformer (see the module). ``model(source, target, source_padding)`` maps (B, Ns) source
    tokens, (B, Nt) target tokens (the decoder's inputs) and the source's (B, Ns) padding (True = a real token) to
    (B, Nt, vocab_size) logits, and leaves the auxiliary loss of every stack's routing heads (commitment) in
    ``aux_loss``; ``after_optimizer_step()`` runs every head group's per-step hook (the k-means steps of the
    encoder's, the decoder's and the cross heads' routing), all-reduced across ranks."""

    config_type = Seq2SeqConfig  # what from_pretrained reads config.json as

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise ValueError(f"config must be a Seq2SeqConfig, got {type(config).__name__}")
        self.config = config
        enc, dec = config.encoder, config.decoder
        d = dec.dim
        self.embed = nn.Embedding(dec.vocab_size, d)  # one byte embedding for both sequences
        # Both stacks absolute: one table (the longer stack's), so that source and target position i embed alike and
        # a cross head can align by position from its first steps (measured below, INIT_GAIN).
        self.shared_positions = enc.positions == dec.positions == "absolute"
        if self.shared_positions:
            self.positions = PositionEmbedding(enc if enc.seq_len >= dec.seq_len else dec)
        else:
            self.source_positions = PositionEmbedding(enc) if enc.positions in ("absolute", "factorized") else None
            self.target_positions = PositionEmbedding(dec) if dec.positions in ("absolute", "factorized") else None
        self.encoder = nn.ModuleList(Block(enc, spec, i, causal=False) for i, spec in enumerate(enc.head_groups()))
        self.encoder_norm = nn.LayerNorm(d)
        self.decoder = nn.ModuleList(DecoderBlock(config, spec, i) for i, spec in enumerate(dec.head_groups()))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, dec.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.125 / math.sqrt(d))
        for block in self.encoder:
            init_weights(block, enc.depth)
        for block in self.decoder:
            init_weights(block, dec.depth)
        with torch.no_grad():  # the Sparse Transformer's scales times INIT_GAIN: N(0, 1/sqrt(fan-in)) and alike
            for name, p in self.named_parameters():
                if p.dim() >= 2 and name != "head.weight":
                    p.mul_(INIT_GAIN)
        nn.init.zeros_(self.head.weight)
        self.aux_loss: Tensor = torch.zeros(())
        self._executor_device: torch.device | None = None

    def _bind_executors(self, device: torch.device) -> None:
        executor = get_executor(self.config.decoder.backend, device)
        for block in [*self.encoder, *self.decoder]:
            block.attention.bind(executor)
            block.ff.executor = executor
        for block in self.decoder:
            for group in block.cross.groups:
                group.executor = executor
        self._executor_device = device

    def _positions(self, stack: str) -> PositionEmbedding | None:
        """The position embedding of the ``stack`` ('source' or 'target'): the shared table, or the stack's own."""
        return self.positions if self.shared_positions else getattr(self, f"{stack}_positions")

    def _embed(self, tokens: Tensor, positions: PositionEmbedding | None, start: int = 0,
               documents: Tensor | None = None) -> Tensor:
        """The shared byte embedding of (B, N) tokens at positions start … start + N - 1 (B, N, dim), counted from
        each position's document's start where (B, N) ``documents`` (numbered from 0) pack several."""
        x = self.embed(tokens)
        if positions is None:
            return x
        return x + positions(start, tokens.shape[1], tokens.device, documents).to(x.dtype)

    def encode(self, source: Tensor, source_padding: Tensor | None = None,
               documents: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(B, Ns) source tokens -> the memory (B, Ns, dim) and the encoder's auxiliary loss (or None).
        ``documents``: the source's (B, Ns) packed documents (``routeformer.documents``), each encoded as if alone."""
        check_model_tokens(source, self.config.encoder.vocab_size, "source")
        if source_padding is not None and (source_padding.shape != source.shape or source_padding.dtype != torch.bool):
            raise ValueError(f"source_padding must be a (B, Ns) = {tuple(source.shape)} bool tensor (True = a real "
                             f"token), got {tuple(source_padding.shape)} {source_padding.dtype}")
        if source.device != self._executor_device:
            self._bind_executors(source.device)
        documents = check_documents(documents, *source.shape, source.device)
        x = self._embed(source, self._positions("source"), documents=documents)
        aux = None
        for block in self.encoder:
            x, loss = block(x, None, 0, documents, key_padding_mask=source_padding)
            if loss is not None:
                aux = loss if aux is None else aux + loss
        return self.encoder_norm(x), aux

    def forward(self, source: Tensor, target: Tensor, source_padding: Tensor | None = None, *,
                documents: CrossDocuments | None = None) -> Tensor:
        """Logits (B, Nt, vocab) of the target (B, Nt) read after the source (B, Ns) with its padding (True = a real
        token). ``documents``: pairs packed into rows (``CrossDocuments(queries=(B, Nt), memory=(B, Ns))``, ids
        that never decrease along a row): target d reads source d only, and each pair is scored as if it were
        alone (attention, the token shift and positions restart at every boundary on both sides)."""
        check_model_tokens(target, self.config.decoder.vocab_size, "target")
        docs = check_cross_documents(documents, source.shape[0], target.shape[1], source.shape[1], source.device)
        if docs is not None and target.shape[0] != source.shape[0]:
            raise ValueError(f"source and target must have as many rows, got {source.shape[0]} and {target.shape[0]}")
        memory, aux = self.encode(source, source_padding, None if docs is None else docs.memory)
        x = self._embed(target, self._positions("target"), documents=None if docs is None else docs.queries)
        for block in self.decoder:
            x, loss = block(x, memory, source_padding, docs)
            if loss is not None:
                aux = loss if aux is None else aux + loss
        self.aux_loss = aux if aux is not None else x.new_zeros(())
        return self.head(self.norm(x))

    @torch.no_grad()
    def start_decoding(self, source: Tensor, source_padding: Tensor | None = None,
                       max_len: int | None = None) -> Seq2SeqCache:
        """Encode the source once and remember it in every decoder layer; the decoder's self-attention caches for up
        to ``max_len`` target positions (default the decoder's seq_len)."""
        memory, _ = self.encode(source, source_padding)
        n = self.config.decoder.seq_len if max_len is None else positive_int("max_len", max_len)
        p = next(self.parameters())
        return Seq2SeqCache([b.attention.new_cache(source.shape[0], n, p.device, p.dtype) for b in self.decoder],
                            [b.cross.remember(memory, source_padding) for b in self.decoder], n)

    @torch.no_grad()
    def decode(self, target: Tensor, cache: Seq2SeqCache) -> Tensor:
        """Logits (B, n, vocab) of n more target tokens (B, n) after the ``cache.length`` before them: equal to the
        forward's rows at those positions (to rounding), each new position costing its own work only (the source
        encoded once, routing's memory sorted once)."""
        check_model_tokens(target, self.config.decoder.vocab_size, "target")
        start, n = cache.length, target.shape[1]
        if start + n > cache.max_len:
            raise ValueError(f"max_len: {start + n} target positions exceed the cache's max_len={cache.max_len}")
        x = self._embed(target, self._positions("target"), start)
        for block, layer, kept in zip(self.decoder, cache.layers, cache.memory, strict=True):
            x = block.decode(x, layer, start, kept)
        cache.length = start + n
        return self.head(self.norm(x))

    @torch.no_grad()
    def translate(self, source: Tensor, max_new_tokens: int, *, source_padding: Tensor | None = None,
                  start: int = 0, stop: int | None = 0, sampling: Sampling | None = None, beams: int = 1) -> Tensor:
        """Target tokens (B, m), m <= ``max_new_tokens``, decoded after the ``start`` token (byte 0 by default, the
        pairs' separator): greedy, or drawn as ``sampling`` says, or with ``beams`` > 1 beam search (``model.beam``:
        each source's best hypothesis by log-probability per token; the source encoded once per beam, the decoder's
        caches reordered, never re-run); a row ends at ``stop`` (kept, and followed by ``stop`` while the others go
        on); all rows stopped ends the loop. The model is put in evaluation mode."""
        self.eval()
        B = source.shape[0]
        beams = positive_int("beams", beams)
        if beams > 1:
            if sampling is not None or stop is None:
                raise ValueError("beam search is deterministic and needs a stop token: no sampling, and stop set")
            return self._beam_search(source, positive_int("max_new_tokens", max_new_tokens), source_padding,
                                     beams, (start, stop))[0]
        cache = self.start_decoding(source, source_padding, max_new_tokens)
        draw = Sampling(temperature=0.0) if sampling is None else sampling
        generator = None if draw.seed is None else torch.Generator().manual_seed(draw.seed)
        token = torch.full((B, 1), start, dtype=torch.long, device=source.device)
        done = torch.zeros(B, dtype=torch.bool, device=source.device)
        out = []
        for _ in range(max_new_tokens):
            logits = self.decode(token, cache)[:, -1]
            nxt = sample_next(logits, temperature=draw.temperature, top_k=draw.top_k, top_p=draw.top_p,
                              generator=generator)
            if stop is not None:
                nxt = torch.where(done, stop, nxt)
                done = done | (nxt == stop)
            out.append(nxt)
            token = nxt[:, None]
            if stop is not None and bool(done.all()):
                break
        return torch.stack(out, 1) if out else token.new_zeros(B, 0)

    def _beam_search(self, source: Tensor, max_new_tokens: int, source_padding: Tensor | None, beams: int,
                     start_stop: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """``translate`` with ``beams`` > 1: tokens (B, m) and each row's score (``beam.beam_search``)."""
        rows = source.repeat_interleave(beams, 0)
        padding = None if source_padding is None else source_padding.repeat_interleave(beams, 0)
        cache = self.start_decoding(rows, padding, max_new_tokens)
        start, stop = start_stop
        return beam_search(lambda token: self.decode(token, cache)[:, -1],
                           lambda index: reorder_rows(cache.layers, index),
                           source.shape[0], beams, max_new_tokens, start=start, stop=stop, device=source.device)

    def save_pretrained(self, directory: str | Path) -> None:
        """model.safetensors (weights, every stack's routing centroids) and config.json, written atomically."""
        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu") -> Seq2SeqLM:
        """The model saved by ``save_pretrained``; errors name the file and what is wrong with it."""
        return from_pretrained(cls, directory, map_location)

    def hooked(self) -> list[nn.Module]:
        """Every head group (the encoder's, the decoder's, the cross heads), in order."""
        groups: list[nn.Module] = [g for b in self.encoder for g in b.attention.groups]
        for block in self.decoder:
            groups += [*block.attention.groups, *block.cross.groups]
        return groups

    def after_optimizer_step(self, step: int | None = None, group: dist.ProcessGroup | None = None) -> int:
        """Every head group's per-step hook (routing: the k-means step); call after each ``optimizer.step()`` on
        every rank. Returns how many groups had one."""
        return sum(bool(g.after_optimizer_step(step, group)) for g in self.hooked())

    def replicated_state(self) -> dict[str, Tensor]:
        """The buffers every rank must hold bit-identical (routing's k-means state in all three places)."""
        names = {id(m): name for name, m in self.named_modules()}
        return {f"{names[id(g)]}.{key}": buf for g in self.hooked() for key, buf in g.replicated_state().items()}


@dataclass
class Seq2SeqCache:
    """Decoding state: each decoder layer's self-attention cache and remembered memory, the target positions
    decoded (``length``) and the most there may be (``max_len``)."""

    layers: list[LayerCache]
    memory: list[CrossMemory]
    max_len: int
    length: int = 0


__all__ = ["CrossAttention", "CrossMemory", "DecoderBlock", "Sampling", "Seq2SeqCache", "Seq2SeqConfig", "Seq2SeqLM"]
