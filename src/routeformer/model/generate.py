"""Sampling from a TransformerLM with per-mechanism decoding caches.

Past the training context (``seq_len``):
- positions 'relative' or 'none': generation continues with the caches. Local and routing heads keep bounded
  ring buffers, so the time per token stays flat; full, strided and fixed heads keep (and attend to) the keys
  their patterns reach, which grow with the position; Longformer keeps a ring buffer unless global tokens are set.
- positions 'absolute' or 'factorized': there is no embedding past ``seq_len``. Generation uses the caches until
  the sequence reaches ``seq_len`` positions, then the context slides: each further token re-runs the model over
  the last ``seq_len`` tokens (no cache; O(seq_len) work per token).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from .tokens import check_token_ids


def sample_next(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> Tensor:
    """Next tokens (B,) from last-position logits (B, V). temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p  # keep the smallest set whose mass reaches top_p (always the first token)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)


def check_sampling(model: nn.Module, prompt: Tensor, max_new_tokens: int, temperature: float,
                   top_k: int | None, top_p: float | None) -> Tensor:
    if not isinstance(prompt, Tensor):
        prompt = torch.as_tensor(prompt, dtype=torch.long)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty (B, N) or (N,) token tensor, got shape {tuple(prompt.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not isinstance(temperature, numbers.Real) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    vocab = model.config.vocab_size
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, numbers.Real) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if top_k is not None and top_k > vocab:
        raise ValueError(f"top_k ({top_k}) is larger than the vocabulary ({vocab})")
    if prompt.device.type == "cpu":  # before it goes to the model's device (the forward checks CPU tensors only)
        check_token_ids(prompt, vocab)
    return prompt.to(next(model.parameters()).device)


def stream(model: nn.Module, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
           documents: Tensor | None = None) -> Iterator[Tensor]:
    """Yield the new tokens (B,) one position at a time."""
    prompt = check_sampling(model, prompt, max_new_tokens, temperature, top_k, top_p)
    documents = _prompt_documents(documents, prompt)
    yield from _stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, documents)


def generate(model: nn.Module, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             documents: Tensor | None = None) -> Tensor:
    """prompt (B, N) or (N,) -> (B, N + max_new_tokens) tokens. ``documents`` (B, N) or (N,): the prompt's packed
    documents (``TransformerLM.forward``); the new tokens continue each row's last one."""
    prompt = check_sampling(model, prompt, max_new_tokens, temperature, top_k, top_p)
    documents = _prompt_documents(documents, prompt)
    new = list(_stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, documents))
    return torch.cat([prompt, torch.stack(new, 1)], 1) if new else prompt


def _prompt_documents(documents: Tensor | None, prompt: Tensor) -> Tensor | None:
    """The prompt's document ids as (B, N) on its device ((N,) for a (N,) prompt); the forward checks the rest."""
    if documents is None:
        return None
    if isinstance(documents, Tensor) and documents.dim() == 1:
        documents = documents[None]
    if not isinstance(documents, Tensor) or tuple(documents.shape) != tuple(prompt.shape):
        raise ValueError(f"documents must be a tensor of the prompt's shape {tuple(prompt.shape)}, got "
                         f"{tuple(getattr(documents, 'shape', ())) or type(documents).__name__}")
    return documents.to(prompt.device)


@torch.no_grad()
def _stream(model: nn.Module, prompt: Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
            top_p: float | None, seed: int | None, documents: Tensor | None = None) -> Iterator[Tensor]:
    """``stream`` on a checked prompt. Runs the model once per new token but the last (whose logits no one needs).
    ``documents`` (B, N): the prompt's packed documents, the new tokens in each row's last (past ``seq_len`` with
    absolute positions, the re-run windows carry their ids)."""
    if max_new_tokens == 0:
        return
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    sample = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "generator": gen}
    was_training = model.training
    model.eval()
    try:
        B, n = prompt.shape
        limit = model.config.seq_len
        sliding = model.config.positions in ("absolute", "factorized")
        # Positions the model will see: the prompt and every new token but the last.
        seen = n + max_new_tokens - 1
        ids = documents
        if sliding:  # the cache serves until the position table ends; then the context slides
            context = prompt[:, -limit:]
            ids = None if documents is None else documents[:, -limit:]
            cache = model.new_cache(B, min(seen, limit)) if n < limit else None
        else:
            context, cache = prompt, model.new_cache(B, seen)
        logits = model(context, cache, documents=ids)[:, -1]
        tokens = context if sliding and seen > limit else None  # kept only for sliding
        nxt = sample_next(logits, **sample)
        yield nxt
        for _ in range(max_new_tokens - 1):
            if tokens is not None:
                tokens = torch.cat([tokens, nxt[:, None]], 1)[:, -limit:]
                ids = None if ids is None else torch.cat([ids, ids[:, -1:]], 1)[:, -limit:]
            if cache is not None and cache.length < cache.max_len:
                logits = model(nxt[:, None], cache)[:, -1]  # each row's last document goes on
            else:  # absolute positions past seq_len: re-run over the last seq_len tokens
                cache = None
                logits = model(tokens, documents=ids)[:, -1]
            nxt = sample_next(logits, **sample)
            yield nxt
    finally:
        model.train(was_training)
