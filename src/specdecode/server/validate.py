"""Request validation: every bad field becomes a 4xx with an OpenAI-style error naming it.

Glossary: a *request* here is the parsed JSON body of ``/v1/completions`` or
``/v1/chat/completions``; validation returns plain values and never touches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SamplingParams, SpecConfig
from ..errors import SpecDecodeError


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": self.code}}


@dataclass
class Request:
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    stream: bool
    gamma: int | str | None
    drafter: str | None  # None: the server's own


def _typed(body: dict, name: str, kinds: tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}", name)
    return value


def parse(body: object, chat: bool, served_model: str, default_max_tokens: int = 128) -> Request:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError(f"model '{model}' does not exist (this server serves '{served_model}')", "model", 404, "model_not_found")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("each message needs a string 'role' and a string 'content'", "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids_ok:
            raise RequestError("'prompt' must be a non-empty string (or one list of token ids)", "prompt")
    n = _typed(body, "n", (int,), 1)
    if n != 1:
        raise RequestError("only n=1 is supported", "n")
    max_tokens = _typed(body, "max_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = _typed(body, "max_completion_tokens", (int,), default_max_tokens)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = _typed(body, "stream", (bool,), False)
    gamma = body.get("gamma")
    drafter = _typed(body, "drafter", (str,), None)
    if drafter is not None and drafter not in ("model", "ngram", "hybrid", "none"):
        raise RequestError("'drafter' must be one of model, ngram, hybrid, none", "drafter")
    try:
        params = SamplingParams(
            temperature=float(_typed(body, "temperature", (int, float), 0.0)),
            top_k=_typed(body, "top_k", (int,), 0),
            top_p=float(_typed(body, "top_p", (int, float), 1.0)),
            max_new_tokens=max_tokens,
            stop=tuple(stop or ()),
            seed=_typed(body, "seed", (int,), None),
            ignore_eos=_typed(body, "ignore_eos", (bool,), False),
        )
        if gamma is not None:
            if isinstance(gamma, bool) or not isinstance(gamma, (int, str)):
                raise SpecDecodeError("gamma must be an integer >= 1 or 'auto'", field="gamma")
            SpecConfig(gamma=gamma)
    except SpecDecodeError as exc:
        param = {"max_new_tokens": "max_tokens"}.get(exc.field, exc.field)
        raise RequestError(str(exc).replace("max_new_tokens", "max_tokens"), param) from None
    return Request(prompt, messages, params, stream, gamma, drafter)
