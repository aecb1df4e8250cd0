"""Test models: tiny transformers models built from configs, a char tokenizer, and a table model."""

from __future__ import annotations

import string

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

ARCHS = ("llama", "gpt2", "qwen2")


def tiny_model(arch: str, seed: int, vocab_size: int = 96, dtype=torch.float64, max_positions: int = 256, init: float = 0.4):
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                             initializer_range=init, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                             initializer_range=init, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=max_positions,
                            initializer_range=init, bos_token_id=1, eos_token_id=2)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def perturbed(model, scale: float, seed: int):
    """A copy of model with noise on every weight: a related, imperfect draft."""
    import copy

    clone = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp(min=1e-3))
    return clone


CHARS = string.ascii_lowercase + string.digits + " .,:;!?()[]{}<>=+-*/\n_'\"#"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: specials 0..2, then one id per character."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    return fast


class TableRunner:
    """An order-2 Markov language model as a Runner: logits depend on the last two tokens.

    It has no float state to drift, so it runs the real engine thousands of times a second
    for the statistical tests. Truncation keeps exactly the committed tokens.
    """

    max_batch = 1 << 20

    @property
    def supports_batches(self) -> bool:
        return self.max_batch > 1

    def __init__(self, vocab_size: int, seed: int, sharpness: float = 1.5):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, vocab_size, generator=g, dtype=torch.float64) * sharpness
        self.vocab_size = vocab_size
        self.max_context = 1 << 20
        self.device = torch.device("cpu")
        self.tokens: list[list[int]] = [[]]

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.tokens])

    def reset(self, batch_size: int = 1) -> None:
        self.tokens = [[] for _ in range(batch_size)]

    def prefill(self, ids: torch.Tensor, rows=None) -> torch.Tensor:
        if rows is None:
            self.reset(ids.shape[0])
        else:
            for r in rows:
                self.tokens[r] = []
        return self.forward(ids, rows=rows)[:, -1]

    def forward(self, ids: torch.Tensor, rows=None, counts=None) -> torch.Tensor:
        """Append to ``rows`` (default: all); row j keeps its first counts[j] tokens (the rest is padding)."""
        rows = range(len(self.tokens)) if rows is None else rows
        out = []
        for j, (r, new) in enumerate(zip(rows, ids.tolist())):
            row = self.tokens[r]
            seq = row + new
            out.append(torch.stack([self.table[seq[p - 1] if p > 0 else 0, seq[p]] for p in range(len(row), len(seq))]))
            row.extend(new if counts is None else new[: counts[j]])
        return torch.stack(out)

    def forward_last(self, ids: torch.Tensor, rows=None, counts=None) -> torch.Tensor:
        """ids [n, S] -> logits [n, V] after each row's last real token."""
        logits = self.forward(ids, rows=rows, counts=counts)  # [n, S, V]
        ends = torch.tensor([ids.shape[1]] * ids.shape[0] if counts is None else [int(c) for c in counts]) - 1
        return logits[torch.arange(ids.shape[0]), ends]

    def truncate(self, lengths: torch.Tensor) -> None:
        if any(int(n) > len(row) or int(n) < 0 for row, n in zip(self.tokens, lengths)):
            raise ValueError("cannot grow by truncation")
        self.tokens = [row[: int(n)] for row, n in zip(self.tokens, lengths)]

    def next_logits(self, context: list[int]) -> torch.Tensor:
        prev = context[-2] if len(context) > 1 else 0
        return self.table[prev, context[-1]]


def decode(engine, prompt, params, eos_ids=(), generator=None, stats=None):
    """One request through SpecEngine.generate (a batch of one): its steps, in order.

    prompt: ids [1, T] or a token list; generator: the request's random stream (default: seeded
    from params.seed, else 0); stats: a GenerationStats to fill."""
    from specdecode.engine import Request
    from specdecode.sampling import seeded_generator
    from specdecode.stats import GenerationStats

    ids = prompt[0].tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    if generator is None:
        generator = seeded_generator(0 if params.seed is None else params.seed)
    request = Request(ids, params.max_new_tokens, generator, stats if stats is not None else GenerationStats())
    return engine.generate([request], params, eos_ids, batch_size=1)


def serve_in_thread(app):
    """Run an ASGI app on a free 127.0.0.1 port in a thread; a context manager yielding the port."""
    import contextlib
    import threading
    import time

    import uvicorn

    from specdecode.bench.llama_server import free_port

    @contextlib.contextmanager
    def running():
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        assert server.started
        try:
            yield port
        finally:
            server.should_exit = True
            thread.join(10)

    return running()


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (how a "gpt2" GGUF vocabulary spells bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def write_gguf(model, tok, path, q8_0: bool = False, merges: tuple[str, ...] = ("a b",)) -> None:
    """A qwen2 GGUF of a transformers Qwen2 model with tied embeddings and the char tokenizer:
    float32, or with every matrix in Q8_0 (q8_0). merges: llama.cpp needs at least one, and
    transformers reads only merges whose result is a token (none is, in the char vocabulary)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    c = model.config
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    spell = _byte_chars()
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t if i <= 2 else "".join(spell[b] for b in t.encode()) for t, i in vocab])
    writer.add_token_types([3 if i <= 2 else 1 for _, i in vocab])
    if merges:
        writer.add_token_merges(list(merges))
    else:  # transformers then derives the merges from the scores
        writer.add_token_scores([0.0] * len(vocab))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp reuses token_embd
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{parts[module]}.{kind}"
        values = tensor.detach().float().numpy()
        if q8_0 and values.ndim == 2:
            writer.add_tensor(gguf_name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
