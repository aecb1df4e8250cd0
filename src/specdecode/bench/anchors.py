"""Measured anchors: what users would otherwise run, timed in the same run as our methods.

Glossary:
- ``llamacpp``: llama-cpp-python (``llama_cpp.Llama``) decoding the target's own GGUF file
  plainly from the same prompt token ids, ``n_threads`` = CPU count; greedy is temperature 0
  (top-k 1); it stops at the same end tokens as ours (at none with ``--ignore-eos``);
- ``llamacpp-server``: a ``llama-server`` binary (``--llama-server``) started over the same GGUF
  and sent the prompt's token ids with ``n_predict`` = max new tokens;
- ``llamacpp-server-spec``: the same binary with ``-md`` the draft's GGUF (llama.cpp's own
  speculative decoding, with its default draft settings);
- ``endpoint``: any OpenAI-compatible server (``--endpoint``) sent the prompt's text;
- *same text*: under greedy, a prompt whose answer text equals ``ar``'s; reported as a count,
  not a failure (llama.cpp's kernels and quantised weights are not ours).
Each is timed over the whole request (prompt prefill + decode), as our methods are.
"""

from __future__ import annotations

import os
import time

from .. import models, packs
from ..config import SamplingParams
from ..errors import SpecDecodeError
from ..text import answer_text
from .endpoint import OpenAIEndpoint
from .llama_server import LlamaServer, find_binary
from .methods import BenchContext, MethodRun, register

SERVER_METHODS = ("llamacpp-server", "llamacpp-server-spec")
ANCHOR_METHODS = ("llamacpp", *SERVER_METHODS, "endpoint")


def _gguf_file(reference: str | None, role: str, method: str) -> str:
    """The GGUF file behind --target / --draft (a pack is assembled if it is not yet)."""
    pack = packs.get_pack(reference or "")
    if pack is not None:
        return str(packs.ensure_assembled(pack, progress=False))
    path = models.gguf_source(reference) if reference else None
    if path is None:
        raise SpecDecodeError(f"method {method} runs llama.cpp over the {role}'s GGUF file: --{role} must be a model pack "
                              f"or a .gguf file, not '{reference}'", field=role)
    return str(path)


class Anchors:
    """The llama.cpp model, server processes and endpoint client of one bench run; close() stops them."""

    def __init__(self, methods: list[str], target: str, draft: str | None, llama_server: str | None,
                 endpoint: str | None, threads: int | None = None):
        chosen = [m for m in methods if m in ANCHOR_METHODS]
        self.threads = threads or os.cpu_count() or 1
        self.n_ctx = 512
        self._llama = None
        self._servers: dict[bool, LlamaServer] = {}
        self.server_commands: dict[str, str] = {}  # "plain" / "spec" -> the command line each server ran
        if "llamacpp" in chosen:
            from ..runners.llamacpp import llamacpp_available

            if not llamacpp_available():
                raise SpecDecodeError('method llamacpp needs llama-cpp-python: pip install "specdecode[llamacpp]"', field="methods")
        if any(m in SERVER_METHODS for m in chosen) and llama_server is None:
            raise SpecDecodeError("methods llamacpp-server and llamacpp-server-spec need --llama-server PATH", field="methods")
        if "endpoint" in chosen and endpoint is None:
            raise SpecDecodeError("method endpoint needs --endpoint URL", field="methods")
        self.binary = find_binary(llama_server) if any(m in SERVER_METHODS for m in chosen) else None
        self.target_gguf = next((_gguf_file(target, "target", m) for m in chosen if m != "endpoint"), None)
        self.draft_gguf = _gguf_file(draft, "draft", "llamacpp-server-spec") if "llamacpp-server-spec" in chosen else None
        self.endpoint = OpenAIEndpoint(endpoint) if "endpoint" in chosen else None

    def reserve(self, tokens: int) -> None:
        """Make room for a request of this many tokens (prompt + new) in llama.cpp's context."""
        self.n_ctx = max(self.n_ctx, -(-(tokens + 16) // 256) * 256)

    def llama(self):
        if self._llama is None or self._llama.n_ctx() < self.n_ctx:
            from llama_cpp import Llama

            self._llama = Llama(self.target_gguf, n_ctx=self.n_ctx, n_threads=self.threads,
                                n_threads_batch=self.threads, verbose=False)
        return self._llama

    def server(self, spec: bool) -> LlamaServer:
        if spec not in self._servers:
            self._servers[spec] = LlamaServer(self.binary, self.target_gguf, self.draft_gguf if spec else None,
                                              self.n_ctx, self.threads)
            self.server_commands["spec" if spec else "plain"] = " ".join(self._servers[spec].command)
        return self._servers[spec]

    def describe(self) -> dict:
        return {"target_gguf": self.target_gguf, "draft_gguf": self.draft_gguf, "threads": self.threads,
                "llama_server": self.server_commands or None,
                "endpoint": self.endpoint.describe() if self.endpoint else None}

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        self._llama = None


@register("llamacpp")
def run_llamacpp(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    llm = ctx.anchors.llama()
    stops = set(params.stopping_ids(ctx.spec.eos_ids))
    if params.greedy:
        sampling = dict(temp=0.0, top_k=1)
    else:
        sampling = dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=0.0)
        llm.set_seed(params.seed if params.seed is not None else 0)
    llm.reset()  # no reuse of the last request's cache: every request prefills its prompt
    tokens: list[int] = []
    t0 = time.perf_counter()
    steps = llm.generate(prompt_ids, repeat_penalty=1.0, **sampling)
    for token in steps:
        tokens.append(int(token))
        if token in stops or len(tokens) == params.max_new_tokens:
            break
    steps.close()
    wall = time.perf_counter() - t0
    return MethodRun(tokens, wall, text=answer_text(ctx.spec.tokenizer, prompt_ids, tokens))


def _run_server(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams, spec: bool) -> MethodRun:
    server = ctx.anchors.server(spec)
    t0 = time.perf_counter()
    answer = server.complete(prompt_ids, params)
    wall = time.perf_counter() - t0
    tokens = answer.get("tokens")
    tokens = [int(t) for t in tokens] if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else []
    count = answer.get("tokens_predicted") if not tokens and isinstance(answer.get("tokens_predicted"), int) else None
    extra = {"timings": answer["timings"]} if isinstance(answer.get("timings"), dict) else {}
    return MethodRun(tokens, wall, text=str(answer.get("content", "")), token_count=count, extra=extra)


@register("llamacpp-server")
def run_llamacpp_server(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    return _run_server(ctx, prompt_ids, params, spec=False)


@register("llamacpp-server-spec")
def run_llamacpp_server_spec(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    return _run_server(ctx, prompt_ids, params, spec=True)


def prompt_text(tokenizer, prompt_ids: list[int]) -> str:
    """The text to send for these ids: special tokens kept (a chat template's markers), a
    leading BOS dropped when the tokenizer adds one itself (the server will add it again)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if prompt_ids and bos is not None and prompt_ids[0] == bos and tokenizer.encode("a")[:1] == [bos]:
        prompt_ids = prompt_ids[1:]
    return tokenizer.decode(prompt_ids, skip_special_tokens=False)


@register("endpoint")
def run_endpoint(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    prompt = prompt_text(ctx.spec.tokenizer, prompt_ids)
    t0 = time.perf_counter()
    text, count, answer = ctx.anchors.endpoint.complete(prompt, params)
    wall = time.perf_counter() - t0
    if count is None:  # no usage in the answer: count the text's tokens with the target's tokenizer
        count = len(ctx.spec.tokenizer.encode(text, add_special_tokens=False))
    extra = {k: answer[k] for k in ("usage", "speculative", "timings") if isinstance(answer.get(k), dict)}
    return MethodRun([], wall, text=text, token_count=count, extra=extra)
