"""A direct decode forward for Llama-family models on the int8 or int4 path (Qwen2, Llama).

Glossary:
- *lean forward*: the same tensor ops, in the same order and on the same dtypes, as
  transformers' module tree over ``runners.int8`` or ``runners.int4`` (embedding, rotary tables, per layer: norm,
  fused q/k/v, rotary, cache write, row-wise attention, o_proj, residual, norm, fused gate/up,
  activation, down_proj, residual; final norm, head), called straight from one loop. What it
  drops is the per-module Python around them (decorators, keyword plumbing, mask building,
  output records): on two CPU cores a 0.5B draft token spends several milliseconds there.
  Its logits are bit-identical to the module path (tested), so the two mix freely over one
  cache.
- *eligible pass*: every row's block 1 to ``ROWWISE_MAX_BLOCK`` tokens (decode, verification
  and prompts that short; one row or several packed back to back without padding). A longer
  prompt prefill keeps the module path and its batched attention; a row with no tokens in the
  pass sends the whole pass down the module path.
- *segments*: the rows of a pass, ``(row, start, count)``: ``count`` tokens for cache row
  ``row`` from slot ``start``, back to back in that order in ``ids``.

``runners.factory`` gives a ``LeanForward`` to an HFRunner whose model ``supports`` accepts;
the runner calls it for eligible passes.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import ROWWISE_ATTENTION, ROWWISE_MAX_BLOCK, PackedLayout, Segment, attend, segment_picks
from .int4 import FusedInt4Member, PerTokenInt4Linear
from .int8 import FusedInt8Member, PerTokenInt8Linear

LEAN_MODEL_TYPES = ("qwen2", "llama")
LEAN_LAYER_CLASSES = ("Qwen2DecoderLayer", "LlamaDecoderLayer")
# the modules each quantized path puts in place of a lone linear and of a fused sibling
LEAN_LINEARS = {PerTokenInt8Linear: FusedInt8Member, PerTokenInt4Linear: FusedInt4Member}


class LeanLayer:
    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = attn.q_proj._group
        self.gate_up = mlp.gate_proj._group
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.act = mlp.act_fn
        self.scaling = attn.scaling
        self.groups = attn.num_key_value_groups
        self.head_dim = attn.head_dim
        self.q_columns, self.k_columns, self.v_columns = (attn.q_proj._columns, attn.k_proj._columns, attn.v_proj._columns)
        self.intermediate = mlp.gate_proj.out_features
        self.query_heads = attn.q_proj.out_features // attn.head_dim


class LeanForward:
    """Decode and verification passes straight through the layers (module glossary)."""

    max_block = ROWWISE_MAX_BLOCK  # longer blocks (a prompt prefill) keep the module path

    def __init__(self, model: nn.Module):
        base = model.model
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.head = model.lm_head
        self.layers = [LeanLayer(layer) for layer in base.layers[: model.config.num_hidden_layers]]

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Only the shapes this loop mirrors op for op: a Llama-family model prepared by
        ``runners.int8.prepare_int8`` or ``runners.int4.prepare_int4`` with full attention in every layer."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
            return False
        if getattr(config, "_attn_implementation", None) != ROWWISE_ATTENTION:
            return False
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return False
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        member = LEAN_LINEARS.get(type(getattr(model, "lm_head", None)))
        if layers is None or member is None:
            return False
        linear = type(model.lm_head)
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            members = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")] + [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
            if not all(isinstance(m, member) for m in members):
                return False
            if not (isinstance(attn.o_proj, linear) and isinstance(mlp.down_proj, linear)):
                return False
            if type(layer).__name__ not in LEAN_LAYER_CLASSES:  # a subclass may change the block
                return False
        return True

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache, segments: list[tuple[int, int, int]], keep_last: bool = False,
                 return_hidden: tuple[int, ...] = ()):
        """ids [T] holding the tokens of several rows back to back; segments [(row, start, count)]
        in that order (count tokens for cache row ``row`` from slot ``start``) -> logits [T, V],
        or [len(segments), V] after each segment's last token with keep_last. return_hidden:
        hidden-state indices (``runners.hf``'s glossary) to return as well: then
        (logits, states [T, len(return_hidden), H]), every position's states whatever keep_last."""
        total = ids.shape[0]
        x = self.embed(ids[None])  # [1, T, H]
        states = {0: x} if 0 in return_hidden else {}
        if len(segments) == 1:
            row, start, _ = segments[0]
            packed, positions = None, torch.arange(start, start + total)
            order = [Segment(0, 0, 0, start, total)]  # key row 0 of the row's own cache view
        else:
            packed = PackedLayout([r for r, _, _ in segments], [s for _, s, _ in segments], [c for _, _, c in segments], x.device)
            positions = packed.token_slots  # a token's cache slot is its position
            order = packed.segments
        picks = segment_picks(order)
        cos, sin = self.rotary(x, positions[None])  # [1, T, D]
        cos, signed_sin = cos.unsqueeze(1), _signed_sin(sin).unsqueeze(1)  # [1, 1, T, D]
        for index, layer in enumerate(self.layers):
            h = layer.input_norm(x).view(total, -1)
            qkv = layer.qkv.rows(h)  # [T, q + k + v]
            # rotary on the query and key heads at once: x * cos + rotate_half(x) * sin, where
            # rotate_half(x) * sin == roll(x, half) * signed_sin bit for bit (a negation is exact)
            qk = qkv[:, : layer.k_columns.stop].reshape(1, total, -1, layer.head_dim).transpose(1, 2)
            qk = (qk * cos) + (qk.roll(layer.head_dim // 2, -1) * signed_sin)  # [1, q + k heads, T, D]
            q, k = qk[:, : layer.query_heads], qk[:, layer.query_heads :]
            v = qkv[:, layer.v_columns].reshape(1, total, -1, layer.head_dim).transpose(1, 2)
            cached = cache.layer(index)
            if packed is None:
                keys, values = cached.write(k, v, [row], [start], cache.rows_total)
            else:
                keys, values = cached.write_packed(k, v, packed, cache.rows_total)
            attn = attend(q, keys, values, picks, layer.groups, layer.scaling).transpose(1, 2).reshape(total, -1)  # [T, H * D]
            x = layer.o_proj.rows(attn).add_(x.view(total, -1))  # residual + attention (addition commutes)
            h = layer.post_norm(x)
            gate_up = layer.gate_up.rows(h)
            hidden = layer.act(gate_up[:, : layer.intermediate]) * gate_up[:, layer.intermediate :]
            x = layer.down_proj.rows(hidden).add_(x).view(1, total, -1)
            if index + 1 in return_hidden:
                states[index + 1] = x
        x = self.norm(x)
        if len(self.layers) in return_hidden:
            states[len(self.layers)] = x  # the last index is the normed state the head reads
        if keep_last:
            x = x[:, [seg.query_start + seg.count - 1 for seg in order]]
        logits = self.head(x)[0]
        if not return_hidden:
            return logits
        return logits, torch.stack([states[i][0] for i in return_hidden], dim=1)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:  # [..., D] -> sin with its first half negated
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
