"""Training a draft head on the target's own features (``specdecode train-head``).

Glossary:
- *self-distillation*: each training prompt is continued by the target's own greedy decode, so
  the head learns what the target says, not what some corpus says.
- *sample*: one prompt plus its continuation, ``tokens`` [T], and the target's *features* at the
  head's layers for every token but the last, [T - 1, L, H] in bfloat16, cached on disk one file
  per prompt under ``OUT/features`` (a rerun reuses them).
- *pair*: position t of a sample: the features of token t with token t + 1's embedding; an
  eagle head learns token t + 2 from it, medusa head i token t + 2 + i. Labels outside the
  draft vocabulary are skipped.
- *unrolled pass*: an eagle head drafts its second token from its own output state where the
  first had the target's features; so each window is also scored with the head's states, one
  position late, in place of the fused features, and both losses count.
- *checkpoint*: ``OUT/checkpoint.pt`` (head, optimizer, step), written every few steps; a
  rerun with the same OUT resumes from it. The finished head is ``OUT/head.pt``, used as
  ``--draft head:OUT/head.pt``.
- *training prompts*: HumanEval tasks 40-163 by default, so benchmarks on tasks 0-19 stay
  unseen, or a prompts file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from .drafters.head import HeadConfig, build_head, default_layers, fingerprint, save_head
from .errors import SpecDecodeError

log = logging.getLogger("specdecode.headtrain")
IGNORE = -100


def collect_features(runner, prompts: Sequence[Sequence[int]], new_tokens: int, layers: tuple[int, ...],
                     folder: Path, eos_ids: Sequence[int] = ()) -> list[Path]:
    """One sample file per prompt (module glossary), skipping those already on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    files, t0 = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        path = folder / f"{i:05d}.pt"
        files.append(path)
        if path.is_file():
            continue
        tokens, states = _continued(runner, list(prompt), new_tokens, layers, set(eos_ids))
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"tokens": torch.tensor(tokens), "features": states.to(torch.bfloat16)}, tmp)
        tmp.replace(path)
        log.info("features %d/%d (%d tokens, %.0f s)", i + 1, len(prompts), len(tokens), time.perf_counter() - t0)
    return files


@torch.inference_mode()
def _continued(runner, prompt: list[int], new_tokens: int, layers, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """The prompt and the target's greedy continuation, and the features of all its tokens but the last [T - 1, L, H]."""
    logits, states = runner.prefill(torch.tensor([prompt]), return_hidden=layers)  # [1, V], [1, T, L, H]
    tokens, parts = list(prompt), [states[0].float()]
    for _ in range(new_tokens):
        token = int(logits[0].argmax())
        tokens.append(token)
        if token in eos:
            break
        step_logits, step_states = runner.forward(torch.tensor([[token]]), return_hidden=layers)
        logits = step_logits[:, -1]
        parts.append(step_states[0].float())
    states = torch.cat(parts)
    return tokens, states[: len(tokens) - 1]


def draft_vocabulary(files: Sequence[Path], size: int, vocab_size: int) -> tuple[int, ...]:
    """The ``size`` target ids seen most often in the samples (all of them when fewer), in id order."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in files:
        counts += torch.bincount(torch.load(path, weights_only=True)["tokens"], minlength=vocab_size)[:vocab_size]
    top = torch.argsort(-counts, stable=True)[: min(size, vocab_size)]  # ties: lowest ids first
    return tuple(sorted(int(i) for i in top))


def pair_batch(sample: dict, config: HeadConfig, index: torch.Tensor, window: int, generator: torch.Generator):
    """A random window of a sample's pairs: (features [W, L, H], next tokens [W], labels [W] or [W, count])."""
    tokens, features = sample["tokens"], sample["features"].float()
    pairs = len(tokens) - 2
    if pairs < 1:
        return None
    start = int(torch.randint(0, max(1, pairs - window + 1), (1,), generator=generator))
    stop = min(pairs, start + window)
    labels = index[tokens]  # draft-vocabulary index of each token, IGNORE outside
    if config.kind == "eagle":
        return features[start:stop], tokens[start + 1 : stop + 1], labels[start + 2 : stop + 2]
    shifted = [torch.cat((labels[start + 2 + i :], torch.full((window + i,), IGNORE)))[: stop - start]
               for i in range(config.medusa_count)]
    return features[start:stop], tokens[start + 1 : stop + 1], torch.stack(shifted, dim=1)


def head_loss(head, embedding, batch) -> torch.Tensor:
    features, next_tokens, labels = batch
    if head.config.kind == "eagle":
        with torch.no_grad():  # the target's embedding stays as it is
            embeds = embedding(next_tokens[None]).float()  # [1, W, H]
        fused = head.fused(features)[None]  # [1, W, H]
        states, logits, _ = head(fused, embeds, 0)
        # a second pass with the head's own states one position late in place of the features,
        # as while drafting past the first token (module glossary: unrolled pass)
        own = torch.cat((fused[:, :1], states[:, :-1]), dim=1)
        _, unrolled, _ = head(own, embeds, 0)
        logits, labels = torch.cat((logits[0], unrolled[0, 1:])), torch.cat((labels, labels[1:]))  # [2W - 1, Vd]
    else:
        logits = head(features[:, -1:]).flatten(0, 1)  # [W * count, Vd]
        labels = labels.flatten()
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE)


def bf16_autocast(device: torch.device) -> bool:
    """Whether bfloat16 autocast is worth it here: a GPU, or a CPU with native bfloat16 dot products."""
    if device.type == "cuda":
        return True
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # AVX512-BF16: torch's only CPU probe
    return bool(probe and probe())


def train(head, embedding, files: Sequence[Path], out: Path, steps: int, lr: float = 1e-3, window: int = 256,
          checkpoint_every: int = 50, seed: int = 0, device: torch.device = torch.device("cpu")):
    """Train ``head`` for ``steps`` windows (resuming OUT/checkpoint.pt when there); returns it."""
    head.train().to(device)
    config = head.config
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    checkpoint, step = out / "checkpoint.pt", 0
    if checkpoint.is_file():
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        if saved["config"] != asdict(config):
            raise SpecDecodeError(f"{checkpoint} holds a head of other settings; use another --out or remove it",
                                  field="out")
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
        log.info("resuming at step %d of %d", step, steps)
    index = torch.full((embedding.num_embeddings,), IGNORE, dtype=torch.long)
    index[list(config.draft_ids)] = torch.arange(len(config.draft_ids))
    generator = torch.Generator().manual_seed(seed + step)
    samples = [torch.load(p, weights_only=True) for p in files]
    autocast = bf16_autocast(device)
    t0, running = time.perf_counter(), None
    while step < steps:
        batch = pair_batch(samples[int(torch.randint(0, len(samples), (1,), generator=generator))], config, index,
                           window, generator)
        if batch is None:
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = head_loss(head, embedding, [t.to(device) for t in batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        value = float(loss.detach())
        running = value if running is None else 0.9 * running + 0.1 * value
        if step % checkpoint_every == 0 or step == steps:
            _save_checkpoint(checkpoint, head, optimizer, step)
            log.info("step %d/%d loss %.3f (%.0f s)", step, steps, running, time.perf_counter() - t0)
    return head.eval()


def _save_checkpoint(path: Path, head, optimizer, step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": asdict(head.config), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, tmp)
    tmp.replace(path)


def train_head(model, runner, prompts: Sequence[Sequence[int]], out: str | Path, kind: str = "eagle",
               steps: int = 2000, new_tokens: int = 128, draft_vocab: int = 32768, lr: float = 1e-3,
               window: int = 256, checkpoint_every: int = 50, eos_ids: Sequence[int] = (), seed: int = 0,
               attention_heads: int | None = None) -> Path:
    """Collect features (cached), train and save a head for ``model`` run by ``runner``; returns OUT/head.pt."""
    out = Path(out).expanduser()
    text = model.config.get_text_config()
    layers = default_layers(int(text.num_hidden_layers), kind)
    files = collect_features(runner, prompts, new_tokens, layers, out / "features", eos_ids)
    if not files:
        raise SpecDecodeError("no training prompts", field="prompts_file")
    embedding = model.get_input_embeddings()
    vocab = int(model.get_output_embeddings().out_features)
    heads = attention_heads or int(text.num_attention_heads)
    config = HeadConfig(kind=kind, hidden_size=int(text.hidden_size), layers=layers,
                        draft_ids=draft_vocabulary(files, draft_vocab, vocab), attention_heads=heads,
                        fingerprint=fingerprint(model))
    fresh = build_head(config, model, torch.Generator().manual_seed(seed))
    head = train(fresh, embedding, files, out, steps, lr, window, checkpoint_every, seed, runner.device)
    path = out / "head.pt"
    save_head(path, head)
    log.info("head saved to %s", path)
    return path
