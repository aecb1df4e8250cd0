"""The CPU runners: int8 per-token path (contract, bit-exact batch invariance, exact speculation)
and the llama.cpp draft runner (contract; draft-only)."""

import logging
import os

import pytest
import torch

from specdecode import packs
from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.engine import SpecEngine
from specdecode.errors import SpecDecodeError
from specdecode.runners.factory import choose_runner, hf_runner
from specdecode.runners.hf import HFRunner
from specdecode.runners.int4 import prepare_int4
from specdecode.runners.int8 import FusedInt8Member, PerTokenInt8Linear, prepare_int8
from specdecode.runners.lean import LeanForward
from specdecode.runners.llamacpp_build import llamacpp_available

from helpers import TableRunner, perturbed, tiny_model, decode


def int8_runner(arch, seed=1):
    return hf_runner(prepare_int8(tiny_model(arch, seed=seed, dtype=torch.float32)))


RUNNERS = {
    "hf-llama-fp64": (lambda: HFRunner(tiny_model("llama", seed=1)), 1e-10),
    "hf-gpt2-fp64": (lambda: HFRunner(tiny_model("gpt2", seed=1)), 1e-10),
    "int8-llama": (lambda: int8_runner("llama"), 0.0),
    "int8-qwen2": (lambda: int8_runner("qwen2"), 0.0),
    "int4-qwen2": (lambda: hf_runner(prepare_int4(tiny_model("qwen2", seed=1, dtype=torch.float32))), 0.0),
    "table": (lambda: TableRunner(12, seed=0), 0.0),
}


def block_vs_singles(runner, prefix_len=20, k=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (1, prefix_len + k), generator=g)
    runner.prefill(ids[:, :prefix_len])
    block = runner.forward(ids[:, prefix_len:])[0]  # [k, V]
    singles = []
    for i in range(k):
        runner.truncate(torch.tensor([prefix_len + i]))
        singles.append(runner.forward(ids[:, prefix_len + i : prefix_len + i + 1])[0, 0])
    return block, torch.stack(singles)


@pytest.mark.parametrize("name", list(RUNNERS))
@pytest.mark.parametrize("k", [2, 5, 16])
def test_batch_invariance(name, k):
    make, bound = RUNNERS[name]
    block, singles = block_vs_singles(make(), k=k)
    assert torch.equal(block.argmax(-1), singles.argmax(-1))
    assert (block - singles).abs().max().item() <= bound


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_runner_contract(arch):
    runner = int8_runner(arch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, runner.vocab_size, (1, 24), generator=g)
    whole = runner.prefill(ids)
    runner.prefill(ids[:, :15])
    assert torch.equal(runner.forward(ids[:, 15:])[:, -1], whole)
    runner.forward(ids[:, :4])
    runner.truncate(torch.tensor([10]))
    after = runner.forward(ids[:, 10:])
    runner.prefill(ids[:, :10])
    assert torch.equal(runner.forward(ids[:, 10:]), after)


def test_per_token_linear_is_close_to_float_and_row_independent():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    q = PerTokenInt8Linear(linear)
    x = torch.randn(9, 256)
    x[3] *= 50  # an outlier row does not change the others
    out = q(x)
    assert torch.equal(out[:3], q(x[:3])) and torch.equal(out[4:], q(x[4:]))
    ref = linear(x)
    assert ((out - ref).abs().amax(-1) / ref.abs().amax(-1)).max() < 0.03



def test_fixed_token_quantisation_equals_the_dynamic_kernel_on_an_anchored_block():
    """The fixed scale and zero point are what fbgemm's dynamic linear picks for a block spanning
    -1..+1, so each token gives the same integers as when an anchor row forces that range."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(128, 200)
    q = PerTokenInt8Linear(linear)
    x = torch.randn(12, 128)
    x[2] *= 1e4  # an outlier row
    x[5] = 0.0  # a zero row
    x[7, 3] = -100.0  # a row whose extreme is negative
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    block = torch.cat([torch.tensor([[-1.0, 1.0] + [0.0] * 126]), x / amax])
    anchored = torch.ops.quantized.linear_dynamic(block, q._packed, False)[1:] * amax + linear.bias.detach()
    assert torch.equal(q.rows(x), anchored)


def biased_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, attention_bias=True, mlp_bias=True)
    return LlamaForCausalLM(config).float().eval()


@pytest.mark.parametrize("make", [lambda: tiny_model("qwen2", seed=5, dtype=torch.float32),
                                  lambda: tiny_model("llama", seed=5, dtype=torch.float32), biased_llama],
                         ids=["qwen2", "llama", "llama-biases"])
def test_lean_decode_loop_is_bit_identical_to_the_module_path(make):
    model = prepare_int8(make())
    assert LeanForward.supports(model)
    lean, modules = hf_runner(model), HFRunner(model)  # the second never takes the lean loop
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 96, (3, 30), generator=g)
    steps = [(1, 1), (0, 4), (2, 1), (1, 6), (1, 1)]  # (row, block length)
    results = []
    for runner in (lean, modules):
        runner.reset(3)
        out = [runner.prefill(prompts[r : r + 1, : 10 + 5 * r], rows=[r]) for r in range(3)]
        out.append(runner.prefill(prompts[:1, :7], rows=[0]))  # a short prompt: lean with the head on its last token only
        for step, (row, width) in enumerate(steps):
            out.append(runner.forward(torch.randint(0, 96, (1, width), generator=torch.Generator().manual_seed(step)), rows=[row]))
            if step == 3:
                runner.truncate(runner.lengths - torch.tensor([0, 4, 0]))
        out.append(runner.forward(prompts[:, 20:23]))  # several rows, full blocks
        out.append(runner.forward(prompts[:2, 23:27], rows=[2, 0], counts=[2, 4]))  # ragged rows, packed
        out.append(runner.forward(prompts[:2, 27:28], rows=[0, 1], counts=[0, 1]))  # a row with no tokens
        out.append(runner.prefill(prompts[:, :9]))  # a new batch of short prompts, last logits per row
        out.append(runner.forward(prompts[:, 9:10]))
        results.append(out)
    assert isinstance(lean.fast, LeanForward) and modules.fast is None
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_lean_loop_only_takes_models_it_mirrors():
    assert not LeanForward.supports(tiny_model("qwen2", seed=5, dtype=torch.float32))  # not on the int8 path
    assert not LeanForward.supports(prepare_int8(tiny_model("gpt2", seed=5, dtype=torch.float32)))
    model = prepare_int8(tiny_model("llama", seed=5, dtype=torch.float32))
    layer = model.model.layers[0]
    layer.__class__ = type("PatchedLlamaDecoderLayer", (type(layer),), {})  # a subclass may change the block
    assert not LeanForward.supports(model)


def test_fused_sibling_linears_are_bit_identical_to_separate_ones():
    torch.manual_seed(0)
    model = tiny_model("qwen2", seed=4, dtype=torch.float32)
    layer = model.model.layers[0]
    owners = {"q_proj": layer.self_attn, "k_proj": layer.self_attn, "v_proj": layer.self_attn,
              "gate_proj": layer.mlp, "up_proj": layer.mlp}
    linears = {name: getattr(owner, name) for name, owner in owners.items()}
    separate = {name: PerTokenInt8Linear(lin) for name, lin in linears.items()}
    prepare_int8(model)
    fused = {name: getattr(owner, name) for name, owner in owners.items()}
    assert all(isinstance(m, FusedInt8Member) for m in fused.values())
    x, y = torch.randn(2, 5, linears["q_proj"].in_features), torch.randn(2, 5, linears["q_proj"].in_features)
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # the order the model calls them
        assert torch.equal(fused[name](x), separate[name](x)), name
    # siblings fed different inputs, or one member called twice, still get their own results
    assert torch.equal(fused["k_proj"](y), separate["k_proj"](y))
    assert torch.equal(fused["q_proj"](x), separate["q_proj"](x))
    assert torch.equal(fused["q_proj"](y), separate["q_proj"](y))
    assert torch.equal(fused["v_proj"](x), separate["v_proj"](x))


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_speculative_greedy_over_int8_equals_plain_over_int8(gamma):
    target = prepare_int8(tiny_model("llama", seed=7, dtype=torch.float32))
    draft = prepare_int8(perturbed(tiny_model("llama", seed=7, dtype=torch.float32), 0.03, seed=8))
    plain = SpecEngine(hf_runner(target), None, SpecConfig())
    spec = SpecEngine(hf_runner(target), ModelDrafter(hf_runner(draft)), SpecConfig(gamma=gamma))
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        prompt = torch.randint(0, 96, (1, 12), generator=g)
        params = SamplingParams(max_new_tokens=48)
        assert [t for s in decode(spec, prompt, params) for t in s.tokens] == [t for s in decode(plain, prompt, params) for t in s.tokens]


def test_llamacpp_is_refused_as_target():
    with pytest.raises(SpecDecodeError, match="only run drafts"):
        choose_runner("llamacpp", torch.device("cpu"), torch.float32, "target")
    with pytest.raises(SpecDecodeError, match="unknown runner"):
        choose_runner("fast", torch.device("cpu"), torch.float32, "target")


def test_factory_picks_the_runner_and_its_fast_path(monkeypatch, tmp_path, caplog):
    from specdecode.runners import factory

    cpu = torch.device("cpu")
    monkeypatch.setattr(factory, "kernel_problem", lambda: "no int4 kernel here")
    assert choose_runner("auto", cpu, torch.float32, "target", gguf="m.gguf") == ("int8" if factory.int8_available() else "hf")
    assert choose_runner("auto", cpu, torch.float64, "draft", gguf="m.gguf") == "hf"
    monkeypatch.setattr(factory, "llamacpp_available", lambda: True)
    monkeypatch.setattr(factory, "llamacpp_fast", lambda: True)
    assert choose_runner("auto", cpu, torch.float32, "draft", gguf="m.gguf") == "llamacpp"
    assert choose_runner("auto", cpu, torch.float32, "draft", gguf=None) != "llamacpp"
    # a build that cannot decode the file: an error when asked for by name, else a warning and the fallback
    monkeypatch.setattr(factory, "llamacpp_problem", lambda path, cache: "llama.cpp crashed decoding a probe (exit -11)")
    with pytest.raises(SpecDecodeError, match="crashed decoding a probe.*rebuild it"):
        factory.llamacpp_draft_file("m.gguf", True, "source", None, tmp_path)
    with caplog.at_level(logging.WARNING, logger="specdecode.runners.factory"):
        assert factory.llamacpp_draft_file("m.gguf", False, "source", None, tmp_path) is None
    assert "drafting on the int8 path instead" in caplog.text
    assert factory.fallback_runner(torch.float32) == "int8" and factory.fallback_runner(torch.float64) == "hf"
    with pytest.raises(SpecDecodeError, match="quantises from float32"):
        factory.check_dtype("int8", torch.float64)
    assert isinstance(hf_runner(prepare_int8(tiny_model("qwen2", seed=5, dtype=torch.float32))).fast, LeanForward)
    assert hf_runner(prepare_int8(tiny_model("gpt2", seed=5, dtype=torch.float32))).fast is None
    assert factory.build_runner("hf", tiny_model("qwen2", seed=5)).fast is None  # not on the int8 path


DRAFT_PACK = packs.PACKS[packs.DEFAULT_DRAFT]


@pytest.mark.skipif(not (llamacpp_available() and packs.installed(DRAFT_PACK)),
                    reason='needs llama-cpp-python and the draft pack (pip install ".[models,llamacpp]")')
def test_llamacpp_runner_contract_on_the_draft_pack():
    from specdecode.runners.llamacpp import LlamaCppRunner

    runner = LlamaCppRunner(str(packs.ensure_assembled(DRAFT_PACK, progress=False)), n_ctx=256)
    ids = torch.arange(1000, 1040)[None]
    runner.prefill(ids[:, :30])
    first = runner.forward(ids[:, 30:36])  # [1, 6, V]
    assert first.shape == (1, 6, runner.vocab_size) and runner.lengths.tolist() == [36]
    runner.forward(ids[:, :3])
    runner.truncate(torch.tensor([30]))
    again = runner.forward(ids[:, 30:36])  # same block size after a rollback: identical
    assert torch.equal(first, again)
    whole = runner.prefill(ids[:, :36])
    assert torch.equal(whole.argmax(-1), first[:, -1].argmax(-1))
    # the ragged calling convention with one row: rows=[0], counts, forward_last
    assert runner.max_batch == 1 and not runner.supports_batches
    runner.reset(1)
    runner.prefill(ids[:, :30], rows=[0])
    padded = runner.forward(torch.cat([ids[:, 30:36], ids[:, :2]], dim=1), rows=[0], counts=[6])  # [1, 8, V]
    assert runner.lengths.tolist() == [36] and torch.equal(padded[:, :6], first) and not padded[:, 6:].any()
    runner.truncate(torch.tensor([30]))
    assert torch.equal(runner.forward_last(ids[:, 30:36], rows=[0], counts=[6]), first[:, -1])
    for call in (lambda: runner.reset(2), lambda: runner.forward(ids[:, :2], rows=[1]),
                 lambda: runner.prefill(ids[:, :4].repeat(2, 1))):
        with pytest.raises(SpecDecodeError, match="decodes one row"):
            call()


@pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")
def test_llamacpp_probe_turns_a_crash_into_a_message_and_caches_it(tmp_path, monkeypatch):
    from specdecode.runners import llamacpp_build

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    monkeypatch.setattr(llamacpp_build, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    problem = llamacpp_build.llamacpp_problem(str(gguf), tmp_path / "cache")
    assert problem is not None and "segmentation fault" in problem
    monkeypatch.setattr(llamacpp_build, "_PROBE", "raise SystemExit(0)")
    assert llamacpp_build.llamacpp_problem(str(gguf), tmp_path / "cache") == problem  # cached verdict
    assert llamacpp_build.llamacpp_problem(str(gguf), tmp_path / "other") is None


@pytest.mark.parametrize("lean", [True, False])
def test_forward_last_equals_the_last_real_position_of_forward(lean):
    model = prepare_int8(tiny_model("qwen2", seed=5, dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 96, (2, 100), generator=g)
    results = []
    for use_last in (True, False):
        runner = hf_runner(model) if lean else HFRunner(model)
        runner.reset(2)
        out = []
        for ids, rows, counts in ((prompts[:1, :80], [0], None),  # longer than a decode block
                                  (prompts[1:, :3], [1], None),
                                  (prompts[:, 80:86], None, [6, 2]),  # ragged rows
                                  (prompts[:, 86:90], None, None)):
            if use_last:
                out.append(runner.forward_last(ids, rows=rows, counts=counts))
            else:
                logits = runner.forward(ids, rows=rows, counts=counts)
                ends = torch.tensor(counts or [ids.shape[1]] * ids.shape[0]) - 1
                out.append(logits[torch.arange(ids.shape[0]), ends])
        results.append(out + [runner.lengths])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _tiny_gguf(path, vocab: int = 40, width: int = 32):
    """A GGUF with a Q8_0 output head, an F32 embedding and a tokenizer whose last two ids are
    control tokens (types 3); returns (embedding, output bytes per row)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "qwen2")
    tokens = [f"t{i}" for i in range(vocab - 2)] + ["<|a|>", "<|b|>"]
    tokens[14], tokens[35] = "t1t2", "t30t1"  # the results of the two merges
    writer.add_key_value("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges(["t1 t2", "t30 t1"])  # at keep=16 the first is kept, the second names dropped ids
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(30)  # dropped at keep=16: the key goes
    writer.add_vocab_size(vocab)
    embedding = rng.standard_normal((vocab, width)).astype(np.float32)
    output = quantize(rng.standard_normal((vocab, width)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", embedding)
    writer.add_tensor("output.weight", output, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(width, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return embedding, output


def test_trimmed_vocabulary_keeps_low_ids_and_control_tokens(tmp_path):
    import json

    import numpy as np
    from gguf import GGUFReader

    from specdecode.runners.gguf_files import VocabularyMap, trim_vocabulary, vocabulary_file

    embedding, output = _tiny_gguf(tmp_path / "m.gguf")
    trim_vocabulary(str(tmp_path / "m.gguf"), tmp_path / "t.gguf", keep=16)
    fields = GGUFReader(str(tmp_path / "t.gguf")).fields
    kept = list(range(16)) + [38, 39]
    assert json.loads(open(vocabulary_file(tmp_path / "t.gguf")).read()) == {"kept_ids": kept, "source_size": 40}
    assert fields["tokenizer.ggml.tokens"].contents() == [f"t{i}" for i in range(14)] + ["t1t2", "t15", "<|a|>", "<|b|>"]
    assert list(fields["tokenizer.ggml.token_type"].contents()) == [1] * 16 + [3, 3]
    assert fields["tokenizer.ggml.merges"].contents() == ["t1 t2"]
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 16 and fields["tokenizer.ggml.eos_token_id"].contents() == 17
    assert "tokenizer.ggml.padding_token_id" not in fields and fields["qwen2.vocab_size"].contents() == 18
    tensors = {t.name: t for t in GGUFReader(str(tmp_path / "t.gguf")).tensors}
    assert np.array_equal(tensors["token_embd.weight"].data, embedding[kept])
    assert np.array_equal(tensors["output.weight"].data, output[kept])  # quantized rows copied byte for byte
    assert list(tensors["output.weight"].shape) == [32, 18]
    assert np.array_equal(tensors["blk.0.attn_norm.weight"].data, np.ones(32, dtype=np.float32))

    vocabulary = VocabularyMap.of(str(tmp_path / "t.gguf"))
    assert VocabularyMap.of(str(tmp_path / "m.gguf")) is None
    assert vocabulary.own_ids([0, 15, 38, 39, 20]) == [0, 15, 16, 17, 0]  # a dropped id is fed as token 0
    own = torch.arange(18, dtype=torch.float32)[None].repeat(2, 1)  # [2, 18]
    full = vocabulary.source_logits(own)  # [2, 40]
    assert full.shape == (2, 40) and torch.equal(full[:, kept], own)
    assert torch.isinf(full[:, 16:38]).all() and (full[:, 16:38] < 0).all()
    assert torch.softmax(full, -1)[:, 16:38].sum() == 0  # a dropped token is never proposed
    with pytest.raises(ValueError):
        trim_vocabulary(str(tmp_path / "m.gguf"), tmp_path / "u.gguf", keep=0)


@pytest.mark.skipif(not (llamacpp_available() and packs.installed(DRAFT_PACK)),
                    reason='needs llama-cpp-python and the draft pack (pip install ".[models,llamacpp]")')
def test_trimmed_llamacpp_draft_scores_kept_ids_as_the_full_one(tmp_path):
    from specdecode.runners.gguf_files import trimmed_gguf
    from specdecode.runners.llamacpp import LlamaCppRunner

    source = str(packs.ensure_assembled(DRAFT_PACK, progress=False))
    full = LlamaCppRunner(source, n_ctx=256)
    trimmed = LlamaCppRunner(trimmed_gguf(source, 4096, tmp_path), n_ctx=256)
    assert trimmed.vocab_size == full.vocab_size
    ids = torch.tensor([[1000, 2000, 3000, 151644, 4000, 500, 600]])  # kept ids and a control token
    a, b = full.prefill(ids), trimmed.prefill(ids)
    kept = trimmed.vocabulary._to_source
    assert torch.equal(a[:, kept], b[:, kept])  # the same rows of the same weights
    assert (b[0, 4096:151643] == float("-inf")).all()
    step = trimmed.forward(torch.tensor([[100000, 700]]))  # a dropped id in the context is fed as token 0
    assert step.shape == (1, 2, full.vocab_size) and torch.isfinite(step[0, :, kept]).all()


@pytest.mark.skipif(not (llamacpp_available() and packs.installed(DRAFT_PACK)),
                    reason='needs llama-cpp-python and the draft pack (pip install ".[models,llamacpp]")')
def test_requantized_llamacpp_draft_is_cached_smaller_and_close_to_the_source(tmp_path):
    from specdecode.runners.gguf_files import VocabularyMap, requantized_gguf, trimmed_gguf
    from specdecode.runners.llamacpp import LlamaCppRunner

    source = str(packs.ensure_assembled(DRAFT_PACK, progress=False))
    path = requantized_gguf(source, "q4_0", tmp_path)
    assert os.path.getsize(path) < 0.9 * os.path.getsize(source)  # Q4_0 blocks: 4.5 bits a weight
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert kinds["output.weight"] == kinds["blk.0.ffn_up.weight"] == GGMLQuantizationType.Q4_0  # the head too
    written = os.path.getmtime(path)
    assert requantized_gguf(source, "q4_0", tmp_path) == path and os.path.getmtime(path) == written  # cached
    full, requantized = LlamaCppRunner(source, n_ctx=256), LlamaCppRunner(path, n_ctx=256)
    text = b"def fibonacci(n):\n    if n <= 1:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = torch.tensor([full.llm.tokenize(text, add_bos=False)])
    a, b = full.prefill(ids)[0], requantized.prefill(ids)[0]
    assert not torch.equal(a, b)  # other weights ...
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8  # ... that mostly pick the same next token
    trimmed = trimmed_gguf(path, 4096, tmp_path)  # composes with a trimmed vocabulary
    assert VocabularyMap.of(trimmed) is not None and VocabularyMap.of(path) is None
    with pytest.raises(ValueError):
        requantized_gguf(source, "q2_k", tmp_path)


@pytest.mark.skipif(not (llamacpp_available() and packs.installed(DRAFT_PACK)),
                    reason='needs llama-cpp-python and the draft pack (pip install ".[models,llamacpp]")')
def test_llamacpp_draft_prefilled_on_the_int8_path_goes_on_like_its_own_prefill(caplog, monkeypatch):
    from specdecode.models import _load_transformers
    from specdecode.runners.llamacpp import LlamaCppRunner
    from specdecode.runners.llamacpp_state import StateLayout

    source = str(packs.ensure_assembled(DRAFT_PACK, progress=False))
    int8_model = _load_transformers(packs.DEFAULT_DRAFT, torch.device("cpu"), torch.float32, False, "int8")[0]
    own, injected = LlamaCppRunner(source, n_ctx=512), LlamaCppRunner(source, n_ctx=512, prefill_runner=hf_runner(int8_model))
    assert injected.prefills_on_int8 and not own.prefills_on_int8
    text = (b"def fibonacci(n):\n    if n <= 1:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
            b"def factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)\n")
    ids = torch.tensor([own.llm.tokenize(text, add_bos=False)])
    prompt, rest = ids[:, :-10], ids[:, -10:]
    own.prefill(prompt), injected.prefill(prompt)
    assert torch.equal(injected.lengths, own.lengths)
    a, b = own.forward(rest), injected.forward(rest)  # [1, 10, V] after the same prompt
    assert not torch.equal(a, b)  # keys and values from other weights ...
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8  # ... that continue the same way
    injected.truncate(injected.lengths - 4)  # rollback works over a copied cache:
    again = injected.forward(rest[:, -4:])
    injected.truncate(injected.lengths - 4)
    assert torch.equal(injected.forward(rest[:, -4:]), again)  # the same block from the same state: identical
    # the layout check: llama.cpp's own state reads back; a cut or mislabelled one does not
    own.reset(1)
    own.prefill(prompt)
    blob = own._state_blob()
    assert StateLayout.read(blob, prompt.shape[1]) is not None
    assert StateLayout.read(blob[:-1], prompt.shape[1]) is None and StateLayout.read(blob, prompt.shape[1] + 1) is None
    # a build whose layout is not the known one prefills in llama.cpp, with a warning
    monkeypatch.setattr(StateLayout, "read", classmethod(lambda cls, blob, cells: None))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdecode.runners.llamacpp"):
        fallback = LlamaCppRunner(source, n_ctx=512, prefill_runner=hf_runner(int8_model))
    assert not fallback.prefills_on_int8 and "prefills prompts in llama.cpp" in caplog.text
    assert torch.equal(fallback.prefill(prompt), own.prefill(prompt))
