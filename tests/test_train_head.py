"""specdecode train-head end to end on a tiny saved model: features, training, checkpoint,
resume, a head loaded by path that drafts exactly, and one-line errors for bad head files."""

import pytest
import torch

from specdecode import SpeculativeGenerator
from specdecode.cli import main
from specdecode.drafters.head import load_head
from specdecode.errors import SpecDecodeError
from specdecode.headtrain import train_head
from specdecode.models import LoadedModel
from specdecode.runners.hf import HFRunner

from helpers import char_tokenizer, tiny_model

PROMPTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n", "x = [1, 2, 3]\ny = x[0]\n"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tok = char_tokenizer()
    model = tiny_model("qwen2", seed=31, vocab_size=len(tok.get_vocab()), dtype=torch.float32)
    root = tmp_path_factory.mktemp("target")
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root, model, tok


def test_training_lowers_the_loss_checkpoints_and_resumes(saved, tmp_path, caplog):
    root, model, tok = saved
    prompts = [tok.encode(p) for p in PROMPTS]
    caplog.set_level("INFO", logger="specdecode")
    path = train_head(model, HFRunner(model), prompts, tmp_path, steps=30, new_tokens=12, draft_vocab=40,
                      window=32, checkpoint_every=10, lr=3e-3)
    losses = [float(r.getMessage().split("loss ")[1].split()[0]) for r in caplog.records if " loss " in r.getMessage()]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert sorted(p.name for p in (tmp_path / "features").iterdir()) == ["00000.pt", "00001.pt", "00002.pt"]
    head = load_head(path, model)
    assert len(head.config.draft_ids) == 40
    caplog.clear()
    train_head(model, HFRunner(model), prompts, tmp_path, steps=40, new_tokens=12, draft_vocab=40, window=32,
               checkpoint_every=10, lr=3e-3)
    messages = [r.getMessage() for r in caplog.records]
    assert any("resuming at step 30" in m for m in messages)
    assert not any(m.startswith("features") for m in messages)  # the feature cache was reused
    assert [m.split()[1] for m in messages if " loss " in m] == ["40/40"]


def test_cli_trains_a_head_that_loads_by_path_and_keeps_greedy_exact(saved, tmp_path, capsys):
    root, model, tok = saved
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": {p!r}}}\n'.replace("'", '"') for p in ["abc = 1\n", "def f(x):\n"]))
    out = tmp_path / "head"
    assert main(["train-head", "--target", str(root), "--out", str(out), "--prompts-file", str(prompts), "--steps", "5",
                 "--new-tokens", "8", "--window", "16", "--runner", "hf"]) == 0
    assert (out / "head.pt").is_file() and (out / "checkpoint.pt").is_file()
    spec = SpeculativeGenerator.from_pretrained(str(root), f"head:{out / 'head.pt'}", gamma=3, runner="hf", progress=False)
    plain = SpeculativeGenerator(LoadedModel("t", spec.target.model, spec.tokenizer), None)
    got, ref = spec.generate("def g(y):", max_new_tokens=30), plain.generate("def g(y):", max_new_tokens=30)
    assert got.token_ids == ref.token_ids
    assert got.stats.drafted_tokens > 0
    assert main(["generate", "--target", str(root), "--draft", f"head:{out / 'head.pt'}", "--runner", "hf",
                 "--max-new-tokens", "8", "abc"]) == 0


def test_bad_head_files_are_one_line_errors(saved, tmp_path, capsys):
    root, model, tok = saved
    assert main(["generate", "--target", str(root), "--draft", f"head:{tmp_path / 'missing.pt'}", "--runner", "hf",
                 "--max-new-tokens", "4", "abc"]) == 2
    assert "no head file" in capsys.readouterr().err
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a head")
    with pytest.raises(SpecDecodeError, match="not a readable head file"):
        load_head(junk, model)
    other = tiny_model("qwen2", seed=32, vocab_size=model.config.vocab_size, dtype=torch.float32)
    path = train_head(other, HFRunner(other), [tok.encode("abc def\n")], tmp_path / "other", steps=1, new_tokens=4,
                      window=8)
    with pytest.raises(SpecDecodeError, match="trained for another target"):
        load_head(path, model)
