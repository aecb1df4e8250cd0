"""HTTP for the bench's anchors: JSON requests, and a client of an OpenAI-compatible completions API.

Glossary:
- *base URL*: the server's address without ``/v1`` (``http://127.0.0.1:8000``); ``--endpoint``
  takes it with or without ``/v1``;
- *whole request*: one blocking ``/v1/completions`` call, streaming off: the server's prompt
  prefill, its decode and the HTTP round trip, timed by the client.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from ..config import SamplingParams
from ..errors import SpecDecodeError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a loopback server never goes through a proxy


def request_json(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    """GET (body None) or POST JSON; -> the decoded answer. Any failure is a one-line SpecDecodeError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    opener = _DIRECT if urllib.parse.urlsplit(url).hostname in LOOPBACK else urllib.request.build_opener()
    try:
        with opener.open(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip().splitlines()
        raise SpecDecodeError(f"{url} answered HTTP {exc.code}" + (f": {detail[0][:200]}" if detail else "")) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise SpecDecodeError(f"cannot reach {url}: {reason}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise SpecDecodeError(f"{url} did not answer with JSON") from None


def base_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecDecodeError(f"--endpoint takes an http(s) URL such as http://127.0.0.1:8000, not '{url}'", field="endpoint")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def sampling_fields(params: SamplingParams) -> dict:
    """OpenAI completions fields for these settings (top_k and ignore_eos are extensions that
    llama-server, vLLM and ``specdecode serve`` read)."""
    fields: dict = {"temperature": params.temperature}
    if not params.greedy:
        fields.update(top_p=params.top_p, **({"top_k": params.top_k} if params.top_k else {}))
        if params.seed is not None:
            fields["seed"] = params.seed
    if params.ignore_eos:
        fields["ignore_eos"] = True
    if params.stop:
        fields["stop"] = list(params.stop)
    return fields


class OpenAIEndpoint:
    """A running OpenAI-compatible server; constructing it checks that it answers."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url = base_url(url)
        self.timeout = timeout
        try:
            listed = request_json(self.url + "/v1/models", timeout=10.0).get("data") or []
        except SpecDecodeError as exc:
            if "answered HTTP" not in str(exc):
                raise SpecDecodeError(f"--endpoint: {exc}", field="endpoint") from None
            listed = []  # it answers, just not with a model list
        self.model = listed[0].get("id") if listed and isinstance(listed[0], dict) else None

    def complete(self, prompt: str, params: SamplingParams) -> tuple[str, int | None, dict]:
        """One whole request -> (text, usage.completion_tokens or None, the answer)."""
        body = {"prompt": prompt, "max_tokens": params.max_new_tokens, "stream": False, **sampling_fields(params)}
        if self.model is not None:
            body["model"] = self.model
        answer = request_json(self.url + "/v1/completions", body, self.timeout)
        try:
            text = answer["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            raise SpecDecodeError(f"{self.url}/v1/completions answered without choices[0].text") from None
        count = (answer.get("usage") or {}).get("completion_tokens")
        return text, count if isinstance(count, int) else None, answer

    def describe(self) -> dict:
        return {"url": self.url, "model": self.model}
