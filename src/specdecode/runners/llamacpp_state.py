"""llama.cpp's sequence state for one sequence, written from keys and values computed elsewhere.

Glossary:
- *prefill on the int8 path*: llama.cpp scores a prompt at about a third of fbgemm's int8 rate
  on these CPUs (a 110-token prompt: 318 against 175 ms for the 0.5B draft), so a llama.cpp
  runner given the same draft model on the int8 path prefills there and copies every layer's
  keys and values into llama.cpp's cache through its sequence-state API
  (``llama_state_seq_set_data``).
- *state layout* (``StateLayout``): that blob's layout is llama.cpp's own and changes between
  versions, so it is checked once: a short probe (``STATE_PROBE``) prefilled by llama.cpp itself
  must read back as the layout written here, with keys close to the int8 path's; otherwise the
  runner prefills in llama.cpp. The keys come from other weights than llama.cpp's (the GGUF
  dequantised to int8 rather than requantized to Q4_0), which only moves the draft: never the output.
"""

from __future__ import annotations

import struct

import numpy as np
import torch


STATE_PROBE = list(range(300, 316))  # low ids: a trimmed vocabulary keeps them


class StateLayout:
    """llama.cpp's sequence-state blob for one sequence of a plain KV cache, as read back from a
    state llama.cpp wrote itself (see ``read``): a 4-byte magic and the sequence id, one stream,
    the cell count, each cell's position, sequence count (1) and sequence id, then whether V is
    transposed (never, with flash attention), the layer count, and per layer the F16 key rows,
    then per layer the F16 value rows. ``read`` returns None for anything else."""

    F16 = 1  # ggml's type id

    def __init__(self, magic: bytes, layers: int, key_width: int, value_width: int):
        self.magic, self.layers, self.key_width, self.value_width = magic, layers, key_width, value_width

    @classmethod
    def read(cls, blob: bytes, cells: int) -> "tuple[StateLayout, list[np.ndarray]] | None":
        """(layout, every layer's keys [cells, key_width]) of a state blob holding ``cells`` cells, or None."""
        try:
            if struct.unpack_from("<iII", blob, 4) != (0, 1, cells):
                return None
            if blob[16 : 16 + 12 * cells] != _cell_records(cells):
                return None
            offset = 16 + 12 * cells
            v_trans, layers = struct.unpack_from("<II", blob, offset)
            offset += 8
            widths, keys = [], []
            for part in ("keys", "values"):
                for _ in range(layers):
                    kind, row_bytes = struct.unpack_from("<iQ", blob, offset)
                    if kind != cls.F16 or row_bytes % 2:
                        return None
                    rows = np.frombuffer(blob, dtype="<f2", count=cells * row_bytes // 2, offset=offset + 12)
                    offset += 12 + cells * row_bytes
                    widths.append(row_bytes // 2)
                    if part == "keys":
                        keys.append(rows.reshape(cells, -1).astype(np.float32))
            if v_trans != 0 or offset != len(blob) or len(set(widths[:layers])) != 1 or len(set(widths[layers:])) != 1:
                return None
        except (struct.error, ValueError):
            return None
        return cls(blob[:4], layers, widths[0], widths[-1]), keys

    def blob(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bytes:
        """The state of one sequence whose cells 0..T-1 hold these keys / values (per layer [T, width])."""
        cells = keys[0].shape[0]
        parts = [self.magic, struct.pack("<iII", 0, 1, cells), _cell_records(cells), struct.pack("<II", 0, self.layers)]
        for rows in list(keys) + list(values):
            half = rows.to(torch.float16).contiguous().numpy()
            parts += [struct.pack("<iQ", self.F16, 2 * half.shape[1]), half.tobytes()]
        return b"".join(parts)


def _cell_records(cells: int) -> bytes:
    """Cells 0..cells-1 of sequence 0: position, one sequence id, that id (int32 each)."""
    return np.array([(i, 1, 0) for i in range(cells)], dtype="<i4").tobytes()


def head_major_rows(per_layer: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer [kv heads, cells, head dim] -> [cells, kv heads * head dim], the order llama.cpp keeps them in."""
    return [t.transpose(0, 1).reshape(t.shape[1], -1) for t in per_layer]
