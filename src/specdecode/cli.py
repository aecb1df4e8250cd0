"""Command line: ``specdecode generate | bench | tune | serve | models | ...`` (argument parsing -> config -> calls).

Glossary: every user error ends as one line ``specdecode: error: ...`` on stderr and exit 2;
the library's log records (``specdecode.*`` loggers, INFO and up) appear as ``specdecode: ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from . import packs
from .bench.suites import read_prompts_file
from .config import ADAPTIVE_DRAFT_CONFIDENCE, DEFAULT_DRAFT_PREFILL, DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB, DRAFT_PREFILLS, DRAFT_QUANTS, draft_prefill_for, parse_draft_vocab
from .errors import SpecDecodeError


class _StderrHandler(logging.StreamHandler):
    """Writes each record to the sys.stderr of that moment, as ``specdecode: [level: ]message``."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)

    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"specdecode: {level}{record.getMessage()}"


_LOG_HANDLER = _StderrHandler()


def configure_logging(level: int = logging.INFO) -> None:
    """The library's ``specdecode.*`` loggers report on stderr from this level up."""
    logger = logging.getLogger("specdecode")
    if _LOG_HANDLER not in logger.handlers:
        logger.addHandler(_LOG_HANDLER)
    logger.setLevel(level)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise SpecDecodeError(f"{self.prog}: {message}")


def _add_model_args(p: argparse.ArgumentParser, draft_default: str | None = packs.DEFAULT_DRAFT) -> None:
    p.add_argument("--target", default=packs.DEFAULT_TARGET, help="target model: pack name, .gguf, directory or hub id (default: %(default)s)")
    p.add_argument("--draft", default=draft_default, help="draft model reference, 'ngram' for prompt lookup, 'head:PATH' for a draft head made by "
                   "train-head, or 'none' for plain decoding (default: %(default)s)")
    p.add_argument("--gamma", default="5", help="tokens drafted per step, or 'auto' to adapt it each step to maximise "
                   "tokens/s (up to 8, with --draft-confidence 0.7; falls back to plain decoding while drafting does not "
                   "pay, and defers the draft prefill where it would not pay back) (default: %(default)s)")
    p.add_argument("--drafter", default="model", choices=("model", "ngram", "hybrid"),
                   help="model: the draft model; ngram: prompt lookup (no draft model); hybrid: lookup when it finds "
                   "a continuation of 3+ tokens, else the draft model (default: %(default)s)")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="stop drafting after a token the draft model gave less than this probability, 0 = off "
                   f"(default: {ADAPTIVE_DRAFT_CONFIDENCE} with --gamma auto, off with a fixed gamma)")
    p.add_argument("--runner", default="auto", help="target runner: auto, hf, int8 or int4 (default: %(default)s; auto = int4 on CPU in float32 where its kernel builds (AVX-512 VNNI), else int8)")
    p.add_argument("--draft-runner", default="auto", help="draft runner: auto, hf, int8, int4 or llamacpp (default: %(default)s; auto = llamacpp for a GGUF draft when installed with AVX-512 kernels, else int8, on CPU)")
    p.add_argument("--draft-vocab", default="full" if DEFAULT_DRAFT_VOCAB is None else str(DEFAULT_DRAFT_VOCAB),
                   help="token ids a llama.cpp draft scores: its lowest N ids plus the control tokens, or 'full' "
                   "(a cheaper draft token, lower acceptance when the text needs dropped ids; the output is unchanged) (default: %(default)s)")
    p.add_argument("--draft-quant", default=DEFAULT_DRAFT_QUANT, choices=DRAFT_QUANTS,
                   help="weights a llama.cpp draft runs: 'source' as its GGUF ships, or a copy llama.cpp requantizes to "
                   "q4_0 / q8_0 once and caches (q4_0: a cheaper draft token, slightly lower acceptance; the output "
                   "is unchanged) (default: %(default)s)")
    p.add_argument("--draft-prefill", default=None, choices=DRAFT_PREFILLS,
                   help="where a llama.cpp draft prefills a prompt: int8 (the same model on the int8 path, about twice "
                   "as fast; its keys and values are copied into llama.cpp; loading that model adds about 8 s) or "
                   f"llamacpp; the output is unchanged either way (default: {DEFAULT_DRAFT_PREFILL}, but llamacpp for "
                   "a single-prompt generate, where the load costs more than it saves)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or float64 (default: %(default)s)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence token: always generate --max-new-tokens (a benchmark "
                   "then compares every method over the same number of tokens)")


def _add_suite_args(p: argparse.ArgumentParser, limit: int) -> None:
    p.add_argument("--suite", default="humaneval", help="humaneval, humaneval-chat or file:PATH (default: %(default)s)")
    p.add_argument("--limit", type=int, default=limit, help="number of prompts (default: %(default)s)")
    p.add_argument("--offset", type=int, default=0, help="first prompt index (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdecode", description="Exact speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it")
    gen.add_argument("prompt", nargs="?", help="the prompt text ('-' reads standard input)")
    gen.add_argument("--prompts-file", default=None,
                     help="JSONL, one object per line: {\"prompt\": ..., optional \"max_new_tokens\", \"seed\", \"id\", \"chat\"}; "
                          "decodes them in batches and prints one JSON object per line, in order")
    gen.add_argument("--batch-size", type=int, default=4,
                     help="rows decoded together with --prompts-file (default: %(default)s; a finished row's slot takes the next prompt)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(gamma="auto")

    bench = sub.add_parser("bench", help="measure methods side by side on a prompt suite")
    _add_model_args(bench)
    _add_sampling_args(bench)
    _add_suite_args(bench, limit=10)
    bench.add_argument("--methods", default=None,
                       help="comma-separated methods: ar, draft, draft-hf, draft-auto, draft-auto-nofill, ngram, hybrid, hf, hf-assisted, hf-lookup, "
                       "llamacpp (llama-cpp-python over the target's GGUF), llamacpp-server, llamacpp-server-spec, endpoint "
                       "(default: ar,draft,draft-hf,ngram,hf,hf-assisted,hf-lookup and those --llama-server / --endpoint add)")
    bench.add_argument("--llama-server", default=None, metavar="PATH",
                       help="a llama.cpp llama-server binary: methods llamacpp-server (plain) and llamacpp-server-spec "
                       "(-md the draft's GGUF) run it over the target's GGUF on a free 127.0.0.1 port, stopped at the end")
    bench.add_argument("--endpoint", default=None, metavar="URL",
                       help="an OpenAI-compatible server (specdecode serve, llama-server, ...): method endpoint sends each "
                       "prompt's text to URL/v1/completions (max_tokens, temperature, streaming off), timing the whole request")
    bench.add_argument("--batch-size", default=None,
                       help="batch sizes, e.g. 1,4,8: measure aggregate tokens/s of batched decoding instead "
                            "(methods ar, draft, ngram, hybrid, hf; default ar,draft,hf)")
    bench.add_argument("--out", default="bench-out/bench.json", help="JSON results; the .md report and PNG plots go beside it")
    bench.add_argument("--no-cost-model", action="store_true", help="skip the k-token cost curve measurement")

    tune = sub.add_parser("tune", help="calibrate the cost model for a pair and recommend gamma")
    _add_model_args(tune)
    _add_sampling_args(tune)
    _add_suite_args(tune, limit=3)

    quality = sub.add_parser("quality", help="top-1 agreement of a quantized CPU path with float32 on HumanEval")
    quality.add_argument("--target", default=packs.DEFAULT_TARGET, help="model reference (default: %(default)s)")
    quality.add_argument("--runner", default="int8", choices=("int8", "int4"), help="the path compared (default: %(default)s)")
    quality.add_argument("--limit", type=int, default=20, help="HumanEval tasks (default: %(default)s)")
    quality.add_argument("--offset", type=int, default=0, help="first task (default: %(default)s)")
    quality.add_argument("--out", default=None, help="write the JSON result here too")

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument("--model-name", default=None, help="the model id clients ask for (default: the target reference)")
    serve.add_argument("--max-batch", type=int, default=8,
                       help="requests decoded together; new ones join the running batch at the next step (default: "
                       "%(default)s; above 1 an auto draft runner is int8, which batches)")
    serve.add_argument("--max-waiting", type=int, default=64,
                       help="queued requests past which a new one gets 429 with Retry-After (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take from its arrival, queueing included (default: no limit)")
    serve.set_defaults(gamma="auto")

    table = sub.add_parser("runners", help="measure each CPU path: k-token pass cost and batch invariance")
    table.add_argument("--target", default=packs.DEFAULT_TARGET, help="model reference (default: %(default)s)")
    table.add_argument("--out", default=None, help="write the JSON rows here too")

    load = sub.add_parser("loadtest", help="drive a running server with concurrent streaming clients")
    load.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    load.add_argument("--model", default=None, help="model id to ask for (default: the first GET /v1/models lists)")
    load.add_argument("--concurrency", default="1,2,4,8", help="requests in flight per level, comma-separated (default: %(default)s)")
    load.add_argument("--variants", default="default",
                      help="comma-separated: default (no drafter field) or a drafter sent per request: model, ngram, "
                           "hybrid, none (default: %(default)s)")
    _add_suite_args(load, limit=16)
    load.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: %(default)s)")
    load.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    load.add_argument("--seed", type=int, default=None, help="seed sent with every request (default: none)")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every answer max-tokens long")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default: %(default)s)")
    load.add_argument("--out", default="loadtest-out", help="folder for loadtest.json and the plots (default: %(default)s)")

    th = sub.add_parser("train-head", help="train a draft head on the target's own features (use it as --draft head:OUT/head.pt)")
    th.add_argument("--target", default=packs.DEFAULT_TARGET, help="target model reference (default: %(default)s)")
    th.add_argument("--out", required=True, help="folder for the feature cache, checkpoint.pt and head.pt; a rerun resumes")
    th.add_argument("--kind", default="eagle", choices=("eagle", "medusa"), help="head kind (default: %(default)s)")
    th.add_argument("--steps", type=int, default=2000, help="training windows (default: %(default)s)")
    th.add_argument("--new-tokens", type=int, default=128, help="greedy tokens the target adds to each prompt (default: %(default)s)")
    th.add_argument("--prompts-file", default=None, help="JSONL prompts to train on (default: HumanEval tasks 40-163)")
    th.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    th.add_argument("--draft-vocab", type=int, default=32768, help="target ids the head scores, the most frequent (default: %(default)s)")
    th.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    th.add_argument("--window", type=int, default=256, help="positions per training window (default: %(default)s)")
    th.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default: %(default)s)")
    th.add_argument("--runner", default="auto", help="target runner: auto, hf, int8, int4 (default: %(default)s)")
    th.add_argument("--device", default="cpu")
    th.add_argument("--dtype", default="float32")
    th.add_argument("--seed", type=int, default=0)

    mod = sub.add_parser("models", help="list model packs or print a pack's file path")
    mod_sub = mod.add_subparsers(dest="models_command", parser_class=_Parser)
    mod_sub.add_parser("list", help="packs and whether they are installed and cached")
    path = mod_sub.add_parser("path", help="print the assembled GGUF path of a pack (assembling it if needed)")
    path.add_argument("name")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    configure_logging()
    try:
        args = parser.parse_args(argv)
        if args.command == "generate":
            return _generate(args)
        if args.command in ("bench", "tune"):
            from .bench.command import run_command

            print(run_command(args, _sampling_from(args), " ".join(["specdecode", *(argv if argv is not None else sys.argv[1:])])))
            return 0
        if args.command == "serve":
            return _serve(args)
        if args.command == "runners":
            from .bench.runners_table import format_rows, runner_table

            rows = runner_table(args.target)
            print(format_rows(rows))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=2)
            return 0
        if args.command == "loadtest":
            from .bench.loadtest import command as loadtest

            print(loadtest(args))
            return 0
        if args.command == "quality":
            return _quality(args)
        if args.command == "models":
            return _models(args, parser)
        if args.command == "train-head":
            return _train_head(args)
        parser.print_help()
        return 2
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130


def _train_head(args) -> int:
    from . import models
    from .bench.suites import humaneval_tasks
    from .headtrain import train_head

    if args.steps < 1 or args.new_tokens < 0 or args.draft_vocab < 1 or args.window < 2 or args.checkpoint_every < 1:
        raise SpecDecodeError("--steps, --draft-vocab and --checkpoint-every must be >= 1, --window >= 2, --new-tokens >= 0")
    device, dtype = models.parse_device(args.device), models.parse_dtype(args.dtype)
    models.check_reference(args.target, args.runner, "target")
    target = models.load(args.target, device, dtype, True, args.runner, "target")
    if args.prompts_file:
        texts = [spec["prompt"] for _, spec in read_prompts_file(args.prompts_file)]
    else:
        texts = [task["prompt"] for task in humaneval_tasks()[40:]]
    texts = texts[: args.limit] if args.limit else texts
    prompts = [ids for ids in (target.tokenizer.encode(t) for t in texts) if len(ids) >= 2]
    t0 = time.perf_counter()
    path = train_head(target.model, target.make_runner(), prompts, args.out, kind=args.kind, steps=args.steps,
                      new_tokens=args.new_tokens, draft_vocab=args.draft_vocab, lr=args.lr, window=args.window,
                      checkpoint_every=args.checkpoint_every, eos_ids=models.eos_token_ids(target), seed=args.seed)
    print(f"{path}  ({len(prompts)} prompts, {time.perf_counter() - t0:.0f} s; use it as --draft head:{path})")
    return 0


def _sampling_from(args):
    from .config import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _gamma(text: str) -> int | str:
    return text if text == "auto" else int(text) if text.lstrip("-").isdigit() else text


def _draft_reference(args) -> str | None:
    return None if args.drafter == "ngram" else args.draft


def _drafter_kind(args) -> str | None:
    if args.drafter == "ngram" or (args.draft or "").lower() == "ngram":
        return "ngram"
    if (args.draft or "none").lower() == "none":
        return None
    if (args.draft or "").startswith("head:"):
        return "head"
    return args.drafter


def _load_generator(args, progress: bool = True, batched: bool = False, one_prompt: bool = False):
    """The generator the model and drafting flags describe (settings are validated before loading).
    batched: rows are decoded together, so an auto draft runner is one that batches (int8).
    one_prompt: a single request, so a llama.cpp draft prefills in llama.cpp unless told otherwise."""
    from .api import SpeculativeGenerator

    draft_runner = "int8" if batched and args.draft_runner == "auto" and args.device == "cpu" and args.dtype == "float32" else args.draft_runner
    return SpeculativeGenerator.from_pretrained(
        args.target, _draft_reference(args), gamma=_gamma(args.gamma), drafter=_drafter_kind(args),
        draft_confidence=args.draft_confidence, device=args.device, dtype=args.dtype,
        runner=args.runner, draft_runner=draft_runner, draft_vocab=parse_draft_vocab(args.draft_vocab),
        draft_quant=args.draft_quant, draft_prefill=draft_prefill_for(args.draft_prefill, one_prompt), progress=progress,
    )


def _generate_file(args, params) -> int:
    if args.prompt is not None:
        raise SpecDecodeError("give either a prompt or --prompts-file, not both", field="prompt")
    if args.batch_size < 1:
        raise SpecDecodeError("--batch-size must be at least 1", field="batch_size")
    items = [item for _, item in read_prompts_file(args.prompts_file)]
    t0 = time.perf_counter()
    gen = _load_generator(args, progress=True, batched=args.batch_size > 1)
    print(f"[loaded in {time.perf_counter() - t0:.1f}s]", file=sys.stderr, flush=True)
    rows = [{"prompt": gen.encode(item["prompt"], chat=item.get("chat", args.chat)),
             **{k: item[k] for k in ("max_new_tokens", "seed") if k in item}} for item in items]
    batch = gen.generate_batch(rows, params, batch_size=args.batch_size)
    for index, (item, result) in enumerate(zip(items, batch.results)):
        line = {"index": index, **({"id": item["id"]} if "id" in item else {}), "batch_size": batch.stats.batch_size,
                **result.to_dict()}
        print(json.dumps(line), flush=True)
    b = batch.stats
    print(f"[{len(items)} prompts, batch size {b.batch_size}: {b.new_tokens} tokens in {b.wall_seconds:.2f}s, "
          f"{b.tokens_per_second:.2f} tok/s aggregate; {b.target_forwards} batched target forwards, "
          f"{b.rows_per_forward:.2f} rows per forward]", file=sys.stderr)
    return 0


def _generate(args) -> int:
    params = _sampling_from(args)
    if args.prompts_file is not None:
        return _generate_file(args, params)
    if args.prompt is None:
        raise SpecDecodeError("give a prompt (or '-' for standard input, or --prompts-file FILE)", field="prompt")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    t0 = time.perf_counter()
    gen = _load_generator(args, progress=not args.json, one_prompt=True)
    if not args.json:
        print(f"[loaded in {time.perf_counter() - t0:.1f}s]", file=sys.stderr, flush=True)
    stream = gen.stream(prompt, params, chat=args.chat)
    for chunk in stream:
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    result = stream.result
    if args.json:
        out = result.to_dict()
        keys = ("new_tokens", "target_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "tokens_per_target_forward", "wall_seconds", "tokens_per_second")
        out["stats"] = {k: out["stats"][k] for k in keys} | {"detail": out["stats"]}
        print(json.dumps(out))
    else:
        s = result.stats
        print(
            f"\n[{s.new_tokens} tokens in {s.wall_seconds:.2f}s, {s.tokens_per_second:.2f} tok/s; "
            f"{s.target_forwards} target forwards, {s.tokens_per_target_forward:.2f} tokens/forward; "
            f"acceptance {s.acceptance_rate:.2f} ({s.accepted_tokens}/{s.drafted_tokens}); "
            f"draft {s.draft_seconds:.2f}s verify {s.verify_seconds:.2f}s; finish={result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _serve(args) -> int:
    import uvicorn

    from .server.app import create_app

    if not 0 < args.port < 65536:
        raise SpecDecodeError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch < 1 or args.max_waiting < 0:
        raise SpecDecodeError("--max-batch must be at least 1 and --max-waiting at least 0")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise SpecDecodeError(f"--request-timeout must be positive, got {args.request_timeout}")
    gen = _load_generator(args, batched=args.max_batch > 1)
    logging.getLogger("specdecode").removeHandler(_LOG_HANDLER)  # the server's log lines carry times instead
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(gen, args.model_name or args.target, max_batch=args.max_batch, max_waiting=args.max_waiting,
                     timeout=args.request_timeout, start_scheduler=False)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="specdecode-http", daemon=True)
    http.start()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop request ends like Ctrl-C
    try:  # the thread that loaded the models decodes (see scheduler.Scheduler)
        app.state.scheduler.run(keep_going=http.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        app.state.scheduler.close()
        http.join(10)
    return 0 if server.started else 1


def _quality(args) -> int:
    from .bench.quality import top1_agreement

    if args.limit < 1 or args.offset < 0:
        raise SpecDecodeError("--limit must be >= 1 and --offset >= 0")
    result = top1_agreement(args.target, args.limit, args.offset, args.runner)
    print(f"{result['model']}: {args.runner} vs float32 top-1 agreement {result['top1_agreement']:.4f} over "
          f"{result['positions']} positions of {result['tasks']} HumanEval solutions; "
          f"mean KL(float32 || {args.runner}) {result['mean_kl_float32_to_quantized']:.4f} nats")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _models(args, parser) -> int:
    if args.models_command == "list":
        for row in packs.status_rows():
            state = "converted" if row["converted"] else "assembled" if row["assembled"] else "installed" if row["installed"] else "not installed"
            print(f"{row['name']:32} {state:14} {row['description']}")
        return 0
    if args.models_command == "path":
        pack = packs.get_pack(args.name)
        if pack is None:
            raise SpecDecodeError(f"unknown model pack '{args.name}' (known: {', '.join(packs.PACKS)})")
        print(packs.ensure_assembled(pack, progress=sys.stderr.isatty()))
        return 0
    raise SpecDecodeError("models: choose 'list' or 'path NAME'")


if __name__ == "__main__":
    sys.exit(main())
