"""Model weight files: safetensors read and written by hand, and a Hugging Face folder's weights.

safetensors is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range), then the raw little-endian bytes; reading and writing it here keeps the `safetensors` package out
of the dependencies (the tests cross-check against it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from titanrush.config import ConfigError

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_FIX = "download or export it again"  # the end of every message about a bad weight file
_LFS = b"version https://git-lfs"  # how a Git LFS pointer file starts (a clone without `git lfs pull`)
_LFS_FIX = "run `git lfs pull` in its folder, or download the file itself"


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
    """Read every tensor of a safetensors file into CPU memory.

    Raises:
        ConfigError: the file cannot be read, is truncated, or is not a safetensors file (one line that
            names it; nothing is allocated for a header's sizes before they are checked against the file).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(len(_LFS))
            if head == _LFS:
                raise ConfigError(f"{path} is a Git LFS pointer, not the weights: {_LFS_FIX}")
            n = int.from_bytes(head[:8], "little")
            f.seek(8)
            if size < 10:
                raise _bad(path, f"the file has only {size} bytes")
            if not 2 <= n <= size - 8:
                raise _bad(path, f"header length {n:,}, file size {size:,}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:  # (UnicodeDecodeError included)
                raise _bad(path, f"its header is not JSON: {e}") from None
            if not isinstance(header, dict):
                raise _bad(path, "its header is not a JSON object")
            header.pop("__metadata__", None)
            entries = [_entry(path, name, info) for name, info in header.items()]
            out: dict[str, torch.Tensor] = {}
            for name, dtype, shape, start, end in sorted(entries, key=lambda e: e[3]):
                if 8 + n + end > size:
                    raise ConfigError(
                        f"{path} is truncated: tensor {name} ends at byte {8 + n + end:,}, the file has "
                        f"{size:,}; {_FIX}"
                    )
                t = torch.empty(shape, dtype=dtype)
                f.seek(8 + n + start)
                if f.readinto(memoryview(_bytes_view(t).numpy())) != end - start:
                    raise ConfigError(f"{path} is truncated: tensor {name} could not be read whole; {_FIX}")
                out[name] = t
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e}); {_FIX}") from None
    return out


def _bad(path: str | Path, why: str) -> ConfigError:
    return ConfigError(f"{path} is truncated or not a safetensors file ({why}); {_FIX}")


def _entry(path: str | Path, name: str, info: Any) -> tuple[str, torch.dtype, list[int], int, int]:
    """(name, dtype, shape, start, end) of one header entry, checked: its byte range fits its shape."""
    try:
        dtype = _ST_DTYPES.get(info["dtype"])
        shape, (start, end) = info["shape"], info["data_offsets"]
        ok = all(type(v) is int and v >= 0 for v in [*shape, start, end])
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"its header entry for {name!r} is malformed: {type(e).__name__} {e}") from None
    if not ok:
        raise _bad(path, f"tensor {name}'s shape or data_offsets are not whole numbers >= 0")
    if dtype is None:
        raise ConfigError(f"{path}: tensor {name} has dtype {info['dtype']}, which titanrush does not read")
    if end - start != math.prod(shape) * dtype.itemsize:
        raise _bad(path, f"tensor {name} has {end - start} bytes for shape {shape} and dtype {info['dtype']}")
    return name, dtype, shape, start, end


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view (little-endian on every supported host)."""
    return t.reshape(-1).view(torch.uint8)


def load_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model folder: one or several (indexed) safetensors or pytorch_model.bin files.

    Raises:
        ConfigError: no weights, or an index or weight file that is missing, truncated or not what its
            name says (one line naming the file).
    """
    hf_dir = Path(hf_dir)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (hf_dir / index_name).exists():
            files = _index_files(hf_dir / index_name)
            break
    else:
        files = [n for n in ("model.safetensors", "pytorch_model.bin") if (hf_dir / n).exists()][:1]
    if not files:
        raise ConfigError(
            f"{hf_dir} holds no model.safetensors(.index.json) or pytorch_model.bin: download its weights too"
        )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not (hf_dir / name).exists():
            raise ConfigError(f"{hf_dir / name} is listed in the index but missing; download it again")
        if name.endswith(".safetensors"):
            out.update(load_safetensors(hf_dir / name))
        else:
            out.update(_load_bin(hf_dir / name))
    return out


def _index_files(index: Path) -> list[str]:
    """The weight files an index (`*.index.json`) names in its `weight_map`, each once."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except OSError as e:
        raise ConfigError(f"{index} cannot be read ({e.strerror or e}); {_FIX}") from None
    except ValueError as e:
        raise ConfigError(f"{index} is truncated or not JSON ({e}); {_FIX}") from None
    except (KeyError, TypeError):
        raise ConfigError(f"{index} has no weight_map (tensor name -> file); {_FIX}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}'s weight_map is not a tensor name -> file mapping; {_FIX}")
    files = set(weight_map.values())
    odd = [f for f in files if not isinstance(f, str) or not f or Path(f).name != f]
    if odd:
        raise ConfigError(f"{index}'s weight_map names {odd[0]!r}, not a file of the folder; {_FIX}")
    return sorted(files)


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin: a pickled name -> tensor dict (read with weights_only: no code runs)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(_LFS)) == _LFS:
                raise ConfigError(f"{path} is a Git LFS pointer, not the weights: {_LFS_FIX}")
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e}); {_FIX}") from None
    except ConfigError:
        raise
    except Exception as e:  # torch raises many kinds (RuntimeError, UnpicklingError, EOFError, KeyError ...)
        why = str(e).strip().split(". ")[0].splitlines()[0][:160] if str(e).strip() else ""
        raise ConfigError(
            f"{path} is truncated or not a PyTorch weights file ({type(e).__name__}: {why}); {_FIX}"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(f"{path} does not hold a tensor name -> tensor dict; {_FIX}")
    return sd
