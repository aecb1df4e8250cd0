"""Prompt files and suites: one JSONL reader for bench and generate, one HumanEval loader, CLI logging."""

import json
import logging

import pytest

from specdecode.bench.quality import humaneval_solutions
from specdecode.bench.suites import humaneval_tasks, load_suite, read_prompts_file
from specdecode.cli import configure_logging, main
from specdecode.errors import SpecDecodeError


def test_prompts_file_ids_chat_and_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "id": "first"}\n\n{"prompt": "b", "chat": true, "max_new_tokens": 3}\n')
    prompts = load_suite(f"file:{path}")
    assert [(p.id, p.text, p.chat) for p in prompts] == [("first", "a", False), ("3", "b", True)]
    assert read_prompts_file(path) == [(1, {"prompt": "a", "id": "first"}), (3, {"prompt": "b", "chat": True, "max_new_tokens": 3})]


BAD = [
    ("not json\n", "p.jsonl line 1: not valid JSON"),
    ('\n{"text": "x"}\n', 'p.jsonl line 2: expected an object with a string "prompt"'),
    ('["x"]\n', 'line 1: expected an object with a string "prompt"'),
    ('{"prompt": "x", "max_new_tokens": 0}\n', '"max_new_tokens" must be a positive integer'),
    ('{"prompt": "x", "seed": -1}\n', '"seed" must be a non-negative integer'),
    ('{"prompt": "x", "seed": true}\n', '"seed" must be a non-negative integer'),
    ('{"prompt": "x", "chat": "yes"}\n', '"chat" must be true or false'),
    ("\n\n", "holds no prompts"),
]


@pytest.mark.parametrize("content, message", BAD)
def test_bad_prompts_file_is_the_same_one_line_error_for_bench_and_generate(tmp_path, capsys, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(SpecDecodeError, match=message.replace("[", r"\[")):
        load_suite(f"file:{path}")
    errors = []
    for argv in (["generate", "--prompts-file", str(path)], ["bench", "--suite", f"file:{path}"]):
        assert main(argv) == 2  # the file is read before any model loads
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        errors.append(err)
    assert errors[0] == errors[1] and message in errors[0]


def test_missing_or_binary_prompts_file(tmp_path):
    with pytest.raises(SpecDecodeError, match="cannot read prompts file .*missing.jsonl: No such file"):
        load_suite(f"file:{tmp_path / 'missing.jsonl'}")
    (tmp_path / "b.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecDecodeError, match="not UTF-8"):
        read_prompts_file(tmp_path / "b.jsonl")


def test_one_humaneval_loader_for_suites_and_quality():
    tasks = humaneval_tasks()
    assert len(tasks) == 164 and tasks[0]["task_id"] == "HumanEval/0"
    assert humaneval_solutions(2, offset=5) == [t["prompt"] + t["canonical_solution"] for t in tasks[5:7]]
    assert [p.text for p in load_suite("humaneval", limit=2, offset=5)] == [t["prompt"] for t in tasks[5:7]]
    chat = load_suite("humaneval-chat", limit=1, offset=5)[0]
    assert chat.chat and tasks[5]["prompt"] in chat.text and chat.id == "HumanEval/5"


def test_cli_logging_puts_library_records_on_stderr(capsys):
    configure_logging()
    configure_logging()  # idempotent: one handler
    logging.getLogger("specdecode.packs").info("converting x.gguf")
    logging.getLogger("specdecode.bench").warning("slow machine")
    logging.getLogger("specdecode.bench").debug("not shown")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "specdecode: converting x.gguf\nspecdecode: warning: slow machine\n"


def test_generate_prompts_file_honours_a_line_chat_flag(tmp_path, capsys):
    from helpers import char_tokenizer, tiny_model

    tok = char_tokenizer()
    model = tiny_model("llama", seed=3, vocab_size=len(tok.get_vocab()))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi", "chat": true}\n{"prompt": "hi"}\n')
    common = ["--target", str(tmp_path / "m"), "--draft", "none", "--dtype", "float64", "--max-new-tokens", "6"]
    assert main(["generate", "--prompts-file", str(path), *common]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    singles = []
    for flags in (["--chat"], []):
        assert main(["generate", "hi", "--json", *flags, *common]) == 0
        singles.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert [r["token_ids"] for r in rows] == singles and singles[0] != singles[1]
