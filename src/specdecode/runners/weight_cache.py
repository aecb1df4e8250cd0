"""The int8 and int4 paths' quantized weights: read from the checkpoint one matrix at a time, cached once.

Glossary:
- *checkpoint*: the safetensors files a model was loaded from (``model.safetensors``, or the
  shards ``model.safetensors.index.json`` names). ``CheckpointWeights`` reads one matrix's
  float weights at a time through a mapping of its own, released once the matrix is quantised;
  reading them through the model's tensors would leave every page read resident, because the
  model's norms and embeddings keep its mapping of the whole file alive.
- *entry kind* (``Tensors``): what a path's entry holds per matrix (``runners.int8.Int8Matrix``).
  ``INT8``: its int8 values ``<name>.int8`` [out, in] and float64 row scales ``<name>.scale``
  [out]: everything the int8 path derives from the float weights except fbgemm's packed layout,
  which has no serialised form and is made again at every load. ``INT4``: the int4 path's
  packed layout itself (``runners.int4``: codes, scales, mins, super-scales), read as it is.
- *GGUF blocks*: a checkpoint converted from a GGUF file keeps that file beside it in the
  cache; where the file stores a matrix's tensor as Q4_K and its values are the checkpoint's
  float tensor, the int4 path takes the file's own blocks (``runners.int4.gguf_rows``), so the
  target runs exactly the published weights; other tensors are quantised from the floats.
- *entry*: one cache file, ``$SPECDECODE_CACHE/<kind>/<model folder>-<key>.safetensors``
  (kind ``int8`` or ``int4``), holding every matrix of one model for that kind.
- *key*: a digest of the checkpoint's identity (each file's resolved path, size and modification
  time), the kind's format (``FORMAT_VERSION``, ``INT4_FORMAT_VERSION``) and the torch version.
  A changed source, format or quantiser gives another entry, so a stale entry is never read;
  nothing removes old ones.
- *hit*: the entry is whole: its header reads, it holds exactly this model's matrices with their
  shapes and types, and its size is what its header declares. A damaged entry (a truncated or
  foreign file) is rebuilt, with a warning.
- *build*: on a miss the weights are quantised from the checkpoint and streamed into a temporary
  file beside the entry, which is renamed onto the entry once complete; an interrupted build
  never leaves a file under the entry's name.

``SPECDECODE_INT8_CACHE=off`` (or 0, false, no) turns the cache off for both kinds: weights are
then quantised at every load, still one matrix at a time from the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open

from .int4 import (BLOCK_BYTES, GROUP, ROWS, SUPER, Int4Rows, Int4Weight, cat_rows, gguf_rows, pack,
                   quantize_rows as quantize_rows4)
from .int8 import Int8Matrix, quantize_weight, quantized_from

FORMAT_VERSION = 1  # bump when what an int8 entry holds or how it is quantised changes
FORMAT = f"specdecode-int8-v{FORMAT_VERSION}"
INT4_FORMAT_VERSION = 2  # bump when what an int4 entry holds or how it is quantised changes
INT4_FORMAT = f"specdecode-int4-v{INT4_FORMAT_VERSION}"
CACHE_ENV = "SPECDECODE_INT8_CACHE"
_OFF = ("0", "off", "false", "no")

log = logging.getLogger("specdecode.runners.weight_cache")


class Tensors(Protocol):
    """What one path's entries hold per matrix (module glossary: entry kind)."""

    label: str  # the path's name in messages and the cache's folder name

    def format(self) -> str: ...

    def quantize(self, weight: torch.Tensor):  # float32 [out, in] -> the path's weight
        ...

    def layout(self, matrix: Int8Matrix) -> list[tuple[str, str, list[int]]]:  # (suffix, safetensors dtype, shape)
        ...

    def parts(self, weight) -> list[torch.Tensor]:  # in the order of layout()
        ...

    def assemble(self, parts: list[torch.Tensor], matrix: Int8Matrix):  # the inverse of parts()
        ...


class Int8Tensors:
    """An int8 matrix: its float64 row scales ``<name>.scale`` [out] and int8 values ``<name>.int8`` [out, in]."""

    label = "int8"

    def format(self) -> str:
        return FORMAT

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        return quantize_weight(weight)

    def layout(self, matrix: Int8Matrix) -> list[tuple[str, str, list[int]]]:
        out, width = matrix.shape
        return [("scale", "F64", [out]), ("int8", "I8", [out, width])]

    def parts(self, weight: torch.Tensor) -> list[torch.Tensor]:
        return [weight.q_per_channel_scales(), weight.int_repr()]

    def assemble(self, parts: list[torch.Tensor], matrix: Int8Matrix) -> torch.Tensor:
        return quantized_from(parts[1], parts[0])


class Int4Tensors:
    """An int4 matrix in its packed layout (``runners.int4``): float32 super-scales
    ``<name>.superscales``, and uint8 codes ``<name>.codes``, scales ``<name>.scales`` and mins
    ``<name>.mins``, per row block."""

    label = "int4"

    def format(self) -> str:
        return INT4_FORMAT

    def quantize(self, weight: torch.Tensor) -> Int4Weight:
        return pack(quantize_rows4(weight))

    def layout(self, matrix: Int8Matrix) -> list[tuple[str, str, list[int]]]:
        out, width = matrix.shape
        blocks, supers = -(-out // ROWS), -(-width // SUPER)
        groups = supers * SUPER // GROUP
        return [("superscales", "F32", [blocks, supers, 2, ROWS]), ("codes", "U8", [blocks, groups, BLOCK_BYTES]),
                ("scales", "U8", [blocks, groups, ROWS]), ("mins", "U8", [blocks, groups // 2, 2 * ROWS])]

    def parts(self, weight: Int4Weight) -> list[torch.Tensor]:
        return [weight.superscales, weight.codes, weight.scales, weight.mins]

    def assemble(self, parts: list[torch.Tensor], matrix: Int8Matrix) -> Int4Weight:
        return Int4Weight(parts[1], parts[2], parts[3], parts[0], matrix.shape[0])


INT8, INT4 = Int8Tensors(), Int4Tensors()
_WIDTHS = {"F64": 8, "F32": 4, "I8": 1, "U8": 1}


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


def entry_path(cache_root: Path, location: str | Path, files: dict[str, Path], kind: Tensors = INT8,
               gguf: Path | None = None) -> Path:
    """The entry of a checkpoint for one path (module glossary: key); gguf: the GGUF file whose
    blocks it takes (module glossary: GGUF blocks), part of its identity."""
    identity = [kind.format(), torch.__version__]
    for file in sorted({f.resolve() for f in files.values()}) + ([Path(gguf).resolve()] if gguf else []):
        stat = file.stat()
        identity.append([str(file), stat.st_size, stat.st_mtime_ns])
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return cache_root / kind.label / f"{Path(location).name}-{key}.safetensors"


def int8_weights(location: str | Path, cache_root: Path | None):
    """The weight source (``runners.int8.WeightSource``) for a model loaded from ``location``:
    the packed-weight cache under ``cache_root``, or with ``cache_root`` None the checkpoint
    alone; None when ``location`` is not a local safetensors checkpoint."""
    return _weights(location, cache_root, INT8)


def int4_weights(location: str | Path, cache_root: Path | None, gguf: str | Path | None = None):
    """As ``int8_weights``, for the int4 path (``runners.int4.Int4WeightSource``); gguf: the GGUF
    file the checkpoint was converted from, whose Q4_K blocks it then takes (module glossary)."""
    return _weights(location, cache_root, INT4, Path(gguf) if gguf is not None and Path(gguf).is_file() else None)


def _weights(location: str | Path, cache_root: Path | None, kind: Tensors, gguf: Path | None = None):
    files = checkpoint_files(location)
    if files is None:
        return None
    floats = CheckpointWeights(files, kind) if gguf is None else GGUFCheckpointWeights(files, gguf)
    if cache_root is None:
        return floats
    return PackedWeightCache(entry_path(cache_root, location, files, kind, gguf), floats)


class CheckpointWeights:
    """Float weights read from the checkpoint, one matrix at a time (module glossary), quantised for one path."""

    def __init__(self, files: dict[str, Path], kind: Tensors = INT8):
        self.files, self.kind = files, kind

    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, object]]:
        for matrix in matrices:
            yield matrix, self.weight(matrix)

    def weight(self, matrix: Int8Matrix):
        """The matrix as its path's weight."""
        return self.kind.quantize(self.float_weight(matrix))

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


class GGUFCheckpointWeights(CheckpointWeights):
    """int4 weights that take the GGUF file's own Q4_K blocks where they are the checkpoint's
    tensors, and quantise the rest from the floats (module glossary: GGUF blocks)."""

    def __init__(self, files: dict[str, Path], gguf: Path):
        super().__init__(files, INT4)
        self.gguf = gguf
        self._tensors, self._names = None, None

    def weight(self, matrix: Int8Matrix) -> Int4Weight:
        parts = [self._rows(key, linear) for key, linear in zip(matrix.keys, matrix.linears())]
        return pack(parts[0] if len(parts) == 1 else cat_rows(parts))

    def _rows(self, key: str, linear) -> Int4Rows:
        floats = self._read(key, linear)
        tensor = self._tensor(key)
        out, width = floats.shape
        if tensor is not None and tensor.tensor_type.name == "Q4_K" and width % SUPER == 0 and tensor.n_elements == out * width:
            rows = gguf_rows(tensor.data, out, width)
            if (rows.values() - floats).abs().max() <= 1e-6 * floats.abs().max():  # the same numbers, up to rounding
                return rows
            log.debug("%s: the GGUF's Q4_K blocks are not the checkpoint's tensor; quantising its floats", key)
        return quantize_rows4(floats)

    def _tensor(self, key: str):
        """The GGUF tensor behind a checkpoint key, or None."""
        if self._tensors is None:
            import gguf

            reader = gguf.GGUFReader(str(self.gguf))
            field = reader.fields.get("general.architecture")
            arch_name = field.contents() if field is not None else ""
            arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
            blocks = reader.fields.get(f"{arch_name}.block_count")
            self._tensors = {t.name: t for t in reader.tensors}
            self._names = None if arch is None or blocks is None else gguf.get_tensor_name_map(arch, int(blocks.contents()))
        if self._names is None:
            return None
        name = self._names.get_name(key, try_suffixes=(".weight", ".bias"))
        return None if name is None else self._tensors.get(name)


class PackedWeightCache:
    """Quantized weights from the entry on a hit; on a miss quantised from ``floats`` and
    written to the entry on the way (module glossary)."""

    def __init__(self, path: Path, floats: CheckpointWeights):
        self.path, self.floats, self.kind = path, floats, floats.kind

    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, object]]:
        problem = entry_problem(self.path, matrices, self.kind)
        if problem is None:
            log.debug("%s weights from %s", self.kind.label, self.path)
            yield from self._read(matrices)
            return
        if self.path.exists():
            log.warning("the %s weight cache file %s %s; rebuilding it", self.kind.label, self.path, problem)
        log.info("quantising %s into the %s weight cache (once)", self.path.name.rsplit("-", 1)[0], self.kind.label)
        yield from self._build(matrices)
        log.debug("%s weights written to %s", self.kind.label, self.path)

    def _read(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, object]]:
        for matrix in matrices:  # a mapping per matrix, so the pages read are released after each
            with safe_open(self.path, framework="pt") as handle:
                parts = [handle.get_tensor(f"{matrix.name}.{suffix}") for suffix, _, _ in self.kind.layout(matrix)]
            yield matrix, self.kind.assemble(parts, matrix)

    def _build(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, object]]:
        writer = _EntryWriter.start(self.path, matrices, self.kind)
        try:
            for matrix in matrices:
                weight = self.floats.weight(matrix)
                if writer is not None:
                    writer = writer.add(weight)
                yield matrix, weight
            if writer is not None:
                writer = writer.commit()
        finally:
            if writer is not None:
                writer.discard()


def _layout(matrices: list[Int8Matrix], kind: Tensors) -> tuple[dict, int]:
    """An entry's safetensors header for these matrices, and its data size: every matrix's
    tensors of wider types first (so their data stays aligned to their width), widest first,
    then every matrix's byte tensors in matrix order."""
    header: dict = {"__metadata__": {"format": kind.format()}}
    offset = 0
    tensors = [(matrix, suffix, dtype, shape) for matrix in matrices for suffix, dtype, shape in kind.layout(matrix)]
    wide = sorted((t for t in tensors if _WIDTHS[t[2]] > 1), key=lambda t: -_WIDTHS[t[2]])
    for matrix, suffix, dtype, shape in wide + [t for t in tensors if _WIDTHS[t[2]] == 1]:
        size = _WIDTHS[dtype] * math.prod(shape)
        header[f"{matrix.name}.{suffix}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def entry_problem(path: Path, matrices: list[Int8Matrix], kind: Tensors = INT8) -> str | None:
    """None when the entry at ``path`` is a hit for these matrices, else what is wrong with it."""
    if not path.is_file():
        return "does not exist"
    header, data_size = _layout(matrices, kind)
    try:
        with open(path, "rb") as file:
            header_size = struct.unpack("<Q", file.read(8))[0]
        with safe_open(path, framework="pt") as handle:
            if (handle.metadata() or {}).get("format") != kind.format():
                return f"is not in the format {kind.format()}"
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
    """Streams an entry into a temporary file beside it: byte tensors as they come, the wider
    ones (scales) at their place before them at the end; ``commit`` renames it onto the entry.
    Any OSError (a full disk, a read-only cache) is a warning, after which the load goes on
    without writing."""

    def __init__(self, path: Path, matrices: list[Int8Matrix], kind: Tensors):
        header, _ = _layout(matrices, kind)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self.kind, self.header = path, kind, header
        self.temp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        self.data_start = 8 + len(blob)
        self.wide: list[tuple[int, torch.Tensor]] = []  # (data offset, tensor) written at commit
        self.names = iter([f"{m.name}.{suffix}" for m in matrices for suffix, _, _ in kind.layout(m)])
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.temp, "wb")
        try:
            self.file.write(struct.pack("<Q", len(blob)) + blob)
            first_byte_tensor = min((e["data_offsets"][0] for n, e in header.items()
                                     if n != "__metadata__" and _WIDTHS[e["dtype"]] == 1), default=0)
            self.file.seek(self.data_start + first_byte_tensor)  # the byte tensors follow the wider ones
        except OSError:
            self.discard()
            raise

    @classmethod
    def start(cls, path: Path, matrices: list[Int8Matrix], kind: Tensors) -> "_EntryWriter | None":
        try:
            return cls(path, matrices, kind)
        except OSError as exc:
            log.warning("cannot write the %s weight cache file %s (%s); quantising without it", kind.label, path, exc)
            return None

    def add(self, weight) -> "_EntryWriter | None":
        """Writes one matrix's byte tensors; returns the writer, or None after a write failed."""
        try:
            for part in self.kind.parts(weight):
                entry = self.header[next(self.names)]
                if _WIDTHS[entry["dtype"]] == 1:
                    self.file.write(part.contiguous().numpy().data)
                else:
                    self.wide.append((entry["data_offsets"][0], part))
            return self
        except OSError as exc:
            return self._fail(exc)

    def commit(self) -> None:
        """Writes the wider tensors and renames the file onto the entry; returns None (the writer is done)."""
        try:
            for offset, part in self.wide:
                self.file.seek(self.data_start + offset)
                self.file.write(part.contiguous().numpy().data)
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
        log.warning("cannot write the %s weight cache file %s (%s); quantising without it", self.kind.label, self.path, exc)
        self.discard()
        return None
