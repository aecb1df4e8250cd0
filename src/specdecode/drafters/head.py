"""Draft heads: small networks that draft from the target's own hidden states.

Glossary:
- *features*: the target's hidden states at the head's ``layers`` (hidden-state indices, see
  ``runners.hf``) for a committed token, [L, H]. The engine hands them over after every target
  pass (``take_features``); the target's cache holds every committed token but the pending one,
  so a row's features reach up to the token before its pending token.
- *eagle head*: one decoder layer over (the previous token's embedding, a state): the state is
  the fused features ``fuse(F_t)`` of token t paired with token t + 1, and predicts token t + 2;
  while drafting, its own output state stands in for the features of the token it just drafted.
  It keeps a KV cache per row over the *real positions* (pairs with target features); drafted
  positions are dropped at ``commit``, and the accepted tokens come back with their real features.
- *medusa heads*: ``count`` residual blocks on the last normed state F_t; head i predicts
  token t + 2 + i, so one look at the features drafts ``count`` tokens at once. No cache.
- *draft vocabulary*: the target ids a head scores (``draft_ids``, e.g. the 32k most frequent);
  its distribution is zero outside them, so verification stays exact over the full vocabulary.
- *head file*: ``save_head`` writes the config, the weights and the target's *fingerprint*
  (logits width, hidden size, layer count, an embedding checksum); ``load_head`` refuses a file
  made for another target.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..config import SamplingParams
from ..errors import SpecDecodeError
from ..sampling import choose
from .base import Contexts, Draft, padded_draft

HEAD_FORMAT = "specdecode-head-1"
KINDS = ("eagle", "medusa")


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # eagle | medusa
    hidden_size: int  # the target's
    layers: tuple[int, ...]  # hidden-state indices the head reads (medusa: the last one)
    draft_ids: tuple[int, ...]  # target ids of the draft vocabulary, in head order
    attention_heads: int = 8
    intermediate_size: int = 0  # 0: 2 * hidden_size
    medusa_count: int = 4
    rope_base: float = 10000.0
    fingerprint: dict = field(default_factory=dict)  # the target's (module glossary: head file)


def default_layers(num_layers: int, kind: str) -> tuple[int, ...]:
    """Low, middle and high layers for an eagle head; the normed final state for medusa."""
    if kind == "medusa":
        return (num_layers,)
    return tuple(sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 2)}))


def fingerprint(model) -> dict:
    """What a head file must match of its target (module glossary)."""
    config = model.config.get_text_config()
    embed = model.get_input_embeddings().weight
    return {"vocab_size": int(model.get_output_embeddings().out_features), "hidden_size": int(config.hidden_size),
            "num_layers": int(config.num_hidden_layers),
            "embed_checksum": round(float(embed[:256].detach().double().abs().sum()), 3)}


def _rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary positions. x [B, heads, T, d], positions [T]."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)  # [d/2]
    angles = positions.to(torch.float32)[:, None] * freqs[None]  # [T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class EagleHead(nn.Module):
    """One decoder layer over (embedding, state) pairs (module glossary: eagle head)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size or 2 * config.hidden_size
        self.config = config
        self.heads = config.attention_heads
        self.fuse = nn.Linear(len(config.layers) * hidden, hidden, bias=False)
        self.embed_norm, self.state_norm = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(2 * hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.out_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, len(config.draft_ids), bias=False)

    def fused(self, features: torch.Tensor) -> torch.Tensor:  # [..., L, H] -> [..., H]
        return self.fuse(features.flatten(-2))

    def forward(self, state: torch.Tensor, embeds: torch.Tensor, start: int,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """state, embeds [B, T, H] at positions start..start+T-1; past keys/values [B, heads, start, d].
        -> (output states [B, T, H], draft logits [B, T, Vd], (keys, values) [B, heads, start+T, d])."""
        batch, width, hidden = state.shape
        d = hidden // self.heads
        x = torch.cat((self.embed_norm(embeds), self.state_norm(state)), dim=-1)
        q, k, v = self.qkv(x).view(batch, width, 3, self.heads, d).permute(2, 0, 3, 1, 4)  # each [B, heads, T, d]
        positions = torch.arange(start, start + width, device=state.device)
        q, k = _rotate(q, positions, self.config.rope_base), _rotate(k, positions, self.config.rope_base)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        seen = torch.arange(start + width, device=state.device)[None] <= positions[:, None]  # [T, start+T]
        attn = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)  # [B, heads, T, d]
        a = self.o_proj(attn.transpose(1, 2).reshape(batch, width, hidden)) + state
        gate, up = self.gate_up(self.mlp_norm(a)).chunk(2, dim=-1)
        out = a + self.down(nn.functional.silu(gate) * up)
        return out, self.lm_head(self.out_norm(out)), (k, v)


class MedusaHeads(nn.Module):
    """``medusa_count`` residual blocks with their own draft-vocabulary heads (module glossary)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        hidden, vocab = config.hidden_size, len(config.draft_ids)
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(config.medusa_count))
        self.heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(config.medusa_count))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., 1, H] (the last index) -> draft logits [..., count, Vd]."""
        x = features[..., 0, :]
        return torch.stack([head(x + nn.functional.silu(block(x))) for block, head in zip(self.blocks, self.heads)], dim=-2)


def build_head(config: HeadConfig, target_model=None, generator: torch.Generator | None = None) -> nn.Module:
    """A fresh head (weights drawn from ``generator`` when given); with ``target_model`` its
    draft-vocabulary heads start from the target's output rows."""
    if config.kind not in KINDS:
        raise SpecDecodeError(f"unknown head kind '{config.kind}' (choose {' or '.join(KINDS)})", field="head")
    head = EagleHead(config) if config.kind == "eagle" else MedusaHeads(config)
    if generator is not None:
        with torch.no_grad():
            for name, weight in head.named_parameters():
                if weight.dim() == 2 and not (config.kind == "medusa" and name.startswith("blocks.")):
                    nn.init.normal_(weight, 0.0, 1.0 / math.sqrt(weight.shape[1]), generator=generator)
    if target_model is not None:
        rows = _output_rows(target_model, config.draft_ids)
        with torch.no_grad():
            for linear in ([head.lm_head] if config.kind == "eagle" else head.heads):
                linear.weight.copy_(rows)
    return head.float()


def _output_rows(target_model, ids: Sequence[int]) -> torch.Tensor:
    """The target's output-head rows of ``ids``, float32 [len(ids), H] (any quantized head: its own weights)."""
    head = target_model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.shape[0] < max(ids) + 1:
        weight = target_model.get_input_embeddings().weight  # quantized heads keep no float weight
    return weight.detach()[list(ids)].float()


def save_head(path: str | Path, head: nn.Module) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = asdict(head.config)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": HEAD_FORMAT, "config": config, "state": head.state_dict()}, tmp)
    tmp.replace(path)


def load_head(path: str | Path, target_model) -> nn.Module:
    """The head saved at ``path``, checked against ``target_model`` (module glossary: head file)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecDecodeError(f"no head file at {path} (train one with specdecode train-head)", field="draft")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SpecDecodeError(f"{path} is not a readable head file ({type(exc).__name__})", field="draft") from None
    if not isinstance(saved, dict) or saved.get("format") != HEAD_FORMAT:
        raise SpecDecodeError(f"{path} is not a specdecode head file", field="draft")
    raw = dict(saved["config"])
    config = HeadConfig(**{**raw, "layers": tuple(raw["layers"]), "draft_ids": tuple(raw["draft_ids"])})
    expected = fingerprint(target_model)
    if config.fingerprint != expected:
        differ = ", ".join(f"{k} {config.fingerprint.get(k)} vs {v}" for k, v in expected.items()
                           if config.fingerprint.get(k) != v)
        raise SpecDecodeError(f"head {path} was trained for another target ({differ})", field="draft")
    head = build_head(config)
    head.load_state_dict(saved["state"])
    return head.eval()


class HeadDrafter:
    """A Drafter over a draft head and the target's features (module glossary)."""

    def __init__(self, head: nn.Module, embedding: nn.Embedding, vocab_size: int):
        """head: an EagleHead or MedusaHeads; embedding: the target's input embedding; vocab_size: its logits width."""
        self.head = head.eval()
        self.config: HeadConfig = head.config
        self.feature_layers = self.config.layers  # what the engine asks the target for
        self.embedding = embedding
        self.vocab_size = vocab_size
        self.max_batch = 1 << 20
        self._ids = torch.tensor(self.config.draft_ids, dtype=torch.long)
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        self._fed = [0] * batch_size  # real positions in the row's head cache
        self._buffer: list[torch.Tensor | None] = [None] * batch_size  # features [m, L, H] from position _fed
        self._past: list[tuple | None] = [None] * batch_size  # eagle keys/values [1, heads, P, d]
        self._last: list[tuple | None] = [None] * batch_size  # eagle (state [1, 1, H], logits [Vd]) at the last real position

    def take_features(self, rows: Sequence[int], starts: Sequence[int], features: Sequence[torch.Tensor | None]) -> None:
        """features[j] [count, L, H]: the target's states of row rows[j]'s committed tokens from
        position starts[j]; anything the row held from that position on is dropped first."""
        for slot, start, states in zip(rows, starts, features):
            slot, start = int(slot), int(start)
            if start < self._fed[slot]:
                self._cut(slot, start)
            held = self._buffer[slot]
            kept, have = start - self._fed[slot], 0 if held is None else len(held)
            if kept > have:
                raise RuntimeError(f"row {slot}: features from position {start}, but it holds them up to {self._fed[slot] + have}")
            parts = ([] if held is None or kept == 0 else [held[:kept]]) + ([] if states is None else [states.float()])
            self._buffer[slot] = torch.cat(parts) if parts else None

    def start(self, rows: Sequence[int], contexts: Contexts) -> None:
        """Nothing to prefill: the row's features came with the target's prefill."""

    def commit(self, rows: Sequence[int], num_accepted: torch.Tensor) -> None:
        """Drop the drafted positions; the accepted tokens come back with their real features."""
        for slot in rows:
            self._drop_drafts(int(slot))

    @torch.inference_mode()
    def propose(self, rows: Sequence[int], contexts: Contexts, limits: Sequence[int], params: SamplingParams,
                generators: Sequence[torch.Generator], min_confidence: float = 0.0) -> Draft:
        tokens: list[list[int]] = []
        probs: list[list[torch.Tensor]] = []
        for slot, context, limit, generator in zip(rows, contexts, limits, generators):
            row_tokens, row_probs = self._propose_row(int(slot), context, int(limit), params, generator, min_confidence)
            tokens.append(row_tokens)
            probs.append(row_probs)
        dtype = next((row[0].dtype for row in probs if row), torch.float32)
        return padded_draft(tokens, None if params.greedy else probs, self.vocab_size, dtype)

    def _propose_row(self, slot, context, limit, params, generator, min_confidence):
        """Up to ``limit`` tokens after the row's pending token: (tokens, their draft distributions [V])."""
        if len(context) < 2 or limit < 1:
            return [], []
        if self.config.kind == "medusa":
            logits = self._medusa_logits(slot, len(context))  # [count, Vd]
            return self._draw(_rows_of(logits[:limit]), params, generator, min_confidence)
        state, logits = self._feed_real(slot, context)
        return self._draw(self._eagle_steps(slot, len(context) - 1, state, logits, limit), params, generator, min_confidence)

    def _draw(self, steps, params, generator, min_confidence):
        """Draw a token from each step's draft logits [Vd] (``steps`` is sent each drawn token)
        until the steps end or a token falls below min_confidence."""
        tokens, probs = [], []
        draft_logits = next(steps, None)
        while draft_logits is not None:
            full = draft_logits.new_full((self.vocab_size,), float("-inf"))  # [V], zero mass outside the draft ids
            full[self._ids] = draft_logits
            token, dist = choose(full[None], params, generator)
            tokens.append(int(token[0]))
            if dist is not None:
                probs.append(dist[0])
            if min_confidence > 0:
                share = dist[0] if dist is not None else torch.softmax(full, dim=-1)
                if float(share[tokens[-1]]) < min_confidence:
                    break
            draft_logits = _send(steps, tokens[-1])
        return tokens, probs

    def _eagle_steps(self, slot, position, state, logits, limit):
        """The eagle head's draft logits [Vd] one step at a time; the token drawn from each is
        sent back and fed at ``position`` on (a drafted position, dropped at commit)."""
        for step in range(limit):
            token = yield logits
            if step + 1 == limit:
                return
            embeds = self.embedding(torch.tensor([[token]])).float()  # [1, 1, H]
            state, out, self._past[slot] = self.head(state, embeds, position + step, self._past[slot])
            logits = out[0, -1]

    def _feed_real(self, slot: int, context) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the row's unfed (features, next token) pairs; the state [1, 1, H] and logits [Vd] at the last one."""
        self._drop_drafts(slot)
        fed, buffer = self._fed[slot], self._buffer[slot]
        if buffer is not None and len(buffer):
            ends = fed + len(buffer)
            if ends > len(context) - 1:
                raise RuntimeError(f"row {slot} has features past its context ({ends} > {len(context) - 1})")
            embeds = self.embedding(torch.tensor([list(context[fed + 1 : ends + 1])])).float()  # [1, m, H]
            state, logits, self._past[slot] = self.head(self.head.fused(buffer)[None], embeds, fed, self._past[slot])
            self._fed[slot], self._buffer[slot] = ends, None
            self._last[slot] = (state[:, -1:], logits[0, -1])
        if self._fed[slot] != len(context) - 1 or self._last[slot] is None:
            raise RuntimeError(f"row {slot}: the head holds {self._fed[slot]} positions for a context of {len(context)}")
        return self._last[slot]

    def _medusa_logits(self, slot: int, context_length: int) -> torch.Tensor:
        """Draft logits [count, Vd] from the features of the token before the pending one."""
        buffer = self._buffer[slot]
        if buffer is None or self._fed[slot] + len(buffer) != context_length - 1:
            raise RuntimeError(f"row {slot}: no features for the token before its pending one")
        last = buffer[-1:]  # [1, 1, H]
        self._fed[slot], self._buffer[slot] = context_length - 2, last
        return self.head(last)[0]

    def _drop_drafts(self, slot: int) -> None:
        past = self._past[slot]
        if past is not None and past[0].shape[2] > self._fed[slot]:
            self._past[slot] = (past[0][:, :, : self._fed[slot]], past[1][:, :, : self._fed[slot]])

    def _cut(self, slot: int, start: int) -> None:
        """Forget the row's positions from ``start`` on (a new request in the slot: 0)."""
        self._fed[slot], self._last[slot] = start, None
        self._drop_drafts(slot)
        if start == 0:
            self._past[slot] = None


def head_drafter(path: str | Path, target_model, vocab_size: int) -> HeadDrafter:
    """The drafter of the head file at ``path`` for ``target_model`` (a transformers model)."""
    return HeadDrafter(load_head(path, target_model), target_model.get_input_embeddings(), vocab_size)


def _rows_of(logits: torch.Tensor):
    """A step generator over fixed draft logits [n, Vd] (the tokens sent back are not needed)."""
    for row in logits:
        yield row


def _send(steps, token: int):
    try:
        return steps.send(token)
    except StopIteration:
        return None
