"""A llama.cpp ``llama-server`` process the bench starts, asks, and stops.

Glossary:
- *ready*: ``GET /health`` answers 200 (it answers 503 while the model loads);
- *request*: ``POST /completion`` with the prompt as token ids, ``n_predict`` new tokens,
  ``cache_prompt`` off (every request prefills its whole prompt, as ours do) and
  ``return_tokens`` on (servers that do not know it answer with the text and a count).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..config import SamplingParams
from ..errors import SpecDecodeError
from .endpoint import request_json, sampling_fields

STARTUP_SECONDS = 600.0


def find_binary(path: str) -> str:
    """The executable --llama-server names (a path, or a name on PATH); a one-line error otherwise."""
    candidate = Path(path).expanduser()
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate.resolve())
    found = shutil.which(path) if os.sep not in path else None
    if found is None:
        raise SpecDecodeError(f"--llama-server: no executable llama-server at '{path}'", field="llama_server")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``binary -m model [-md draft]`` on a free 127.0.0.1 port, ready when constructed."""

    def __init__(self, binary: str, model: str, draft: str | None, n_ctx: int, threads: int,
                 startup_seconds: float = STARTUP_SECONDS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(n_ctx),
                        "-t", str(threads), "-np", "1", *(["-md", draft] if draft else [])]
        self._log = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        except OSError as exc:
            self._log.close()
            raise SpecDecodeError(f"cannot start {binary}: {exc.strerror}", field="llama_server") from None
        try:
            self._wait_ready(startup_seconds)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise SpecDecodeError(f"llama-server exited with code {code} before it was ready: {self._last_line()}",
                                      field="llama_server")
            try:
                request_json(self.url + "/health", timeout=2.0)
                return
            except SpecDecodeError:
                time.sleep(0.1)
        raise SpecDecodeError(f"llama-server was not ready after {seconds:.0f} s: {self._last_line()}", field="llama_server")

    def _last_line(self) -> str:
        self._log.seek(0)
        lines = [line for line in self._log.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else "(no output)"

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> dict:
        """One whole request -> the server's answer (``content``, ``tokens``, ``tokens_predicted``, ``timings``)."""
        body = {"prompt": list(prompt_ids), "n_predict": params.max_new_tokens, "stream": False,
                "cache_prompt": False, "return_tokens": True, "min_p": 0.0, **sampling_fields(params)}
        body["top_k"] = 1 if params.greedy else params.top_k
        if self.process.poll() is not None:
            raise SpecDecodeError(f"llama-server stopped (code {self.process.returncode}): {self._last_line()}")
        return request_json(self.url + "/completion", body)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
