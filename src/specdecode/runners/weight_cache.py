"""The int8 path's quantized weights: read from the checkpoint one matrix at a time, cached once.

Glossary:
- *checkpoint*: the safetensors files a model was loaded from (``model.safetensors``, or the
  shards ``model.safetensors.index.json`` names). ``CheckpointWeights`` reads one int8 matrix's
  float weights at a time through a mapping of its own, released once the matrix is quantised;
  reading them through the model's tensors would leave every page read resident, because the
  model's norms and embeddings keep its mapping of the whole file alive.
- *entry*: one cache file, ``$SPECDECODE_CACHE/int8/<model folder>-<key>.safetensors``, holding
  for every int8 matrix (``runners.int8.Int8Matrix``) its int8 values ``<name>.int8`` [out, in]
  and its float64 row scales ``<name>.scale`` [out]: everything the int8 path derives from the
  float weights except fbgemm's packed layout, which has no serialised form and is made again
  at every load.
- *key*: a digest of the checkpoint's identity (each file's resolved path, size and modification
  time), ``FORMAT_VERSION`` and the torch version. A changed source, format or quantiser gives
  another entry, so a stale entry is never read; nothing removes old ones.
- *hit*: the entry is whole: its header reads, it holds exactly this model's matrices with their
  shapes and types, and its size is what its header declares. A damaged entry (a truncated or
  foreign file) is rebuilt, with a warning.
- *build*: on a miss the weights are quantised from the checkpoint and streamed into a temporary
  file beside the entry, which is renamed onto the entry once complete; an interrupted build
  never leaves a file under the entry's name.

``SPECDECODE_INT8_CACHE=off`` (or 0, false, no) turns the cache off: weights are then quantised
at every load, still one matrix at a time from the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .int8 import Int8Matrix, quantize_weight, quantized_from

FORMAT_VERSION = 1  # bump when what an entry holds or how it is quantised changes
FORMAT = f"specdecode-int8-v{FORMAT_VERSION}"
CACHE_ENV = "SPECDECODE_INT8_CACHE"
_OFF = ("0", "off", "false", "no")

log = logging.getLogger("specdecode.runners.weight_cache")


def cache_enabled() -> bool:
    """False when ``$SPECDECODE_INT8_CACHE`` turns the cache off (module glossary)."""
    return os.environ.get(CACHE_ENV, "").strip().lower() not in _OFF


def checkpoint_files(location: str | Path) -> dict[str, Path] | None:
    """State-dict key -> safetensors file of a local checkpoint folder; None for anything else
    (a hub id, a .bin checkpoint), whose weights the int8 path then quantises from the model."""
    folder = Path(location)
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.is_file():
        return {key: folder / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
            return {key: single for key in handle.keys()}
    return None


def entry_path(cache_root: Path, location: str | Path, files: dict[str, Path]) -> Path:
    """The entry of a checkpoint (module glossary: key)."""
    identity = [FORMAT, torch.__version__]
    for file in sorted({f.resolve() for f in files.values()}):
        stat = file.stat()
        identity.append([str(file), stat.st_size, stat.st_mtime_ns])
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return cache_root / "int8" / f"{Path(location).name}-{key}.safetensors"


def int8_weights(location: str | Path, cache_root: Path | None):
    """The weight source (``runners.int8.WeightSource``) for a model loaded from ``location``:
    the packed-weight cache under ``cache_root``, or with ``cache_root`` None the checkpoint
    alone; None when ``location`` is not a local safetensors checkpoint."""
    files = checkpoint_files(location)
    if files is None:
        return None
    floats = CheckpointWeights(files)
    return floats if cache_root is None else PackedWeightCache(entry_path(cache_root, location, files), floats)


class CheckpointWeights:
    """Float weights read from the checkpoint, one matrix at a time (module glossary)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, torch.Tensor]]:
        for matrix in matrices:
            yield matrix, quantize_weight(self.float_weight(matrix))

    def float_weight(self, matrix: Int8Matrix) -> torch.Tensor:  # float32 [sum out, in]
        parts = [self._read(key, linear) for key, linear in zip(matrix.keys, matrix.linears())]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _read(self, key: str, linear) -> torch.Tensor:  # float32 [out, in]
        """The checkpoint's tensor, or the model's own where the checkpoint has none of that
        shape (a head tied to the embedding)."""
        file = self.files.get(key)
        if file is not None:
            with safe_open(file, framework="pt") as handle:
                tensor = handle.get_tensor(key)
            if tensor.shape == linear.weight.shape:
                return tensor.to(torch.float32)
        return linear.weight.detach().to(torch.float32)


class PackedWeightCache:
    """Quantized weights from the entry on a hit; on a miss quantised from ``floats`` and
    written to the entry on the way (module glossary)."""

    def __init__(self, path: Path, floats: CheckpointWeights):
        self.path, self.floats = path, floats

    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, torch.Tensor]]:
        problem = entry_problem(self.path, matrices)
        if problem is None:
            log.debug("int8 weights from %s", self.path)
            yield from self._read(matrices)
            return
        if self.path.exists():
            log.warning("the int8 weight cache file %s %s; rebuilding it", self.path, problem)
        log.info("quantising %s into the int8 weight cache (once)", self.path.name.rsplit("-", 1)[0])
        yield from self._build(matrices)
        log.debug("int8 weights written to %s", self.path)

    def _read(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, torch.Tensor]]:
        for matrix in matrices:  # a mapping per matrix, so the pages read are released after each
            with safe_open(self.path, framework="pt") as handle:
                values, scale = handle.get_tensor(f"{matrix.name}.int8"), handle.get_tensor(f"{matrix.name}.scale")
            yield matrix, quantized_from(values, scale)

    def _build(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, torch.Tensor]]:
        writer = _EntryWriter.start(self.path, matrices)
        try:
            for matrix in matrices:
                qweight = quantize_weight(self.floats.float_weight(matrix))
                if writer is not None:
                    writer = writer.add(qweight)
                yield matrix, qweight
            if writer is not None:
                writer = writer.commit()
        finally:
            if writer is not None:
                writer.discard()


def _layout(matrices: list[Int8Matrix]) -> tuple[dict, int]:
    """An entry's safetensors header for these matrices, and its data size: every matrix's
    scales first (so float64 data stays 8-byte aligned), then every matrix's int8 values."""
    header: dict = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for matrix in matrices:
        out = matrix.shape[0]
        header[f"{matrix.name}.scale"] = {"dtype": "F64", "shape": [out], "data_offsets": [offset, offset + 8 * out]}
        offset += 8 * out
    for matrix in matrices:
        size = matrix.shape[0] * matrix.shape[1]
        header[f"{matrix.name}.int8"] = {"dtype": "I8", "shape": list(matrix.shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def entry_problem(path: Path, matrices: list[Int8Matrix]) -> str | None:
    """None when the entry at ``path`` is a hit for these matrices, else what is wrong with it."""
    if not path.is_file():
        return "does not exist"
    header, data_size = _layout(matrices)
    try:
        with open(path, "rb") as file:
            header_size = struct.unpack("<Q", file.read(8))[0]
        with safe_open(path, framework="pt") as handle:
            if (handle.metadata() or {}).get("format") != FORMAT:
                return f"is not in the format {FORMAT}"
            if set(handle.keys()) != set(header) - {"__metadata__"}:
                return "holds other matrices than this model's"
            for name in handle.keys():
                tensor = handle.get_slice(name)
                if tensor.get_shape() != header[name]["shape"] or tensor.get_dtype() != header[name]["dtype"]:
                    return f"holds {name} with another shape or type"
    except Exception as exc:  # a damaged file fails in the safetensors reader with its own error types
        return f"cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
    size, expected = path.stat().st_size, 8 + header_size + data_size
    return None if size == expected else f"is {size} bytes long where its header declares {expected}"


class _EntryWriter:
    """Streams an entry into a temporary file beside it: int8 values as they come, the scales at
    the end; ``commit`` renames it onto the entry. Any OSError (a full disk, a read-only cache)
    is a warning, after which the load goes on without writing."""

    def __init__(self, path: Path, matrices: list[Int8Matrix]):
        header, _ = _layout(matrices)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path = path
        self.temp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        self.scales: list[torch.Tensor] = []
        self.scales_start = 8 + len(blob)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.temp, "wb")
        try:
            self.file.write(struct.pack("<Q", len(blob)) + blob)
            self.file.seek(self.scales_start + sum(8 * m.shape[0] for m in matrices))  # the int8 values follow the scales
        except OSError:
            self.discard()
            raise

    @classmethod
    def start(cls, path: Path, matrices: list[Int8Matrix]) -> "_EntryWriter | None":
        try:
            return cls(path, matrices)
        except OSError as exc:
            log.warning("cannot write the int8 weight cache file %s (%s); quantising without it", path, exc)
            return None

    def add(self, qweight: torch.Tensor) -> "_EntryWriter | None":
        """Writes one matrix's int8 values; returns the writer, or None after a write failed."""
        try:
            self.file.write(qweight.int_repr().numpy().data)
            self.scales.append(qweight.q_per_channel_scales())
            return self
        except OSError as exc:
            return self._fail(exc)

    def commit(self) -> None:
        """Writes the scales and renames the file onto the entry; returns None (the writer is done)."""
        try:
            self.file.seek(self.scales_start)
            for scale in self.scales:
                self.file.write(scale.numpy().data)
            self.file.flush()
            os.fsync(self.file.fileno())  # (an entry of the right size must hold its bytes)
            self.file.close()
            os.replace(self.temp, self.path)
        except OSError as exc:
            self._fail(exc)
        return None

    def discard(self) -> None:
        self.file.close()
        self.temp.unlink(missing_ok=True)

    def _fail(self, exc: OSError) -> None:
        log.warning("cannot write the int8 weight cache file %s (%s); quantising without it", self.path, exc)
        self.discard()
        return None
