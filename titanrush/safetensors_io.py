"""Model weight files: safetensors read and written by hand, and a Hugging Face folder's weights.

safetensors is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range), then the raw little-endian bytes; reading and writing it here keeps the `safetensors` package out
of the dependencies (the tests cross-check against it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from titanrush.config import ConfigError

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write tensors to one safetensors file (tensors laid out back to back in the given order)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data then starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(_bytes_view(t.detach().cpu().contiguous()).numpy()))


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file into CPU memory."""
    size = os.path.getsize(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= size - 8:
            raise ConfigError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConfigError(f"{path} is not a safetensors file (its header is not JSON: {e})") from e
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] not in _ST_DTYPES:
                raise ConfigError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            t = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            if end - start != t.numel() * t.element_size() or 8 + n + end > size:
                raise ConfigError(f"{path}: tensor {name} has inconsistent offsets (truncated file?)")
            f.seek(8 + n + start)
            f.readinto(memoryview(_bytes_view(t).numpy()))
            out[name] = t
    return out


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view (little-endian on every supported host)."""
    return t.reshape(-1).view(torch.uint8)


def load_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model folder: one or several (indexed) safetensors or pytorch_model.bin files."""
    hf_dir = Path(hf_dir)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (hf_dir / index_name).exists():
            files = sorted(set(json.loads((hf_dir / index_name).read_text())["weight_map"].values()))
            break
    else:
        files = [n for n in ("model.safetensors", "pytorch_model.bin") if (hf_dir / n).exists()][:1]
    if not files:
        raise ConfigError(f"{hf_dir} holds no model.safetensors(.index.json) or pytorch_model.bin")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not (hf_dir / name).exists():
            raise ConfigError(f"{hf_dir / name} is listed in the index but missing; download it again")
        if name.endswith(".safetensors"):
            out.update(load_safetensors(hf_dir / name))
        else:
            out.update(torch.load(hf_dir / name, map_location="cpu", weights_only=True))
    return out
