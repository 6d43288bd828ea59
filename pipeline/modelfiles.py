"""What a model folder holds, read as plain files: weights whose headers are whole, a
tokenizer, a chat template. Nothing is loaded, so a 70B folder is checked in
milliseconds on a login node. Torch-free.

Weights are the files transformers would load: the safetensors ones when there
are any (sharded through *.safetensors.index.json, or one model.safetensors),
else the torch.save ones (pytorch_model*.bin, sharded through
pytorch_model.bin.index.json), or a peft adapter's adapter_model.*.

- safetensors: 8 bytes little-endian header length, a JSON header naming every
  tensor's dtype, shape and [begin, end) byte offsets into the data that follows.
  A file cut short, or a header that does not fit its file, is found without
  reading a tensor.
- torch.save: a zip archive (torch >= 1.6; its central directory sits at the end,
  so a truncated file has none) or, before that, a pickle (starts with 0x80).
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

# Files the tokenizer is built from, by the tokenizer kinds transformers loads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "spm.model",
                   "sentencepiece.bpe.model", "*.tiktoken")
# Where transformers finds a chat template: tokenizer_config.json's chat_template, or a
# file of its own (written by transformers >= 4.43).
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
SAFETENSORS_INDEX = "*.safetensors.index.json"
TORCH_INDEX = "pytorch_model*.bin.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors refuses larger headers itself
# Bytes per element of safetensors dtypes (sub-byte and unknown dtypes are not size-checked).
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
REFETCH = "download or save the model again"


class BadModelFile(ValueError):
    """A file of a model folder is missing or would not load; the message says which and why."""


# --------------------------------------------------------------------------- weights


def weight_files(folder: Path) -> list[Path]:
    """The weight files transformers would read from `folder` (shards named by an index
    must exist: BadModelFile otherwise). Empty when there are none."""
    for index_pattern, single in ((SAFETENSORS_INDEX, ("*.safetensors",)),
                                  (TORCH_INDEX, ("pytorch_model*.bin", "adapter_model.bin"))):
        indexes = sorted(folder.glob(index_pattern))
        if indexes:
            return sorted({shard for index in indexes for shard in _shards(index)})
        found = sorted(p for pattern in single for p in folder.glob(pattern))
        if found:
            return found
    return []


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadModelFile(f"{index}: not a readable shard index ({type(err).__name__}: {err}); {REFETCH}") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise BadModelFile(f"{index} names {len(names)} shards, {len(missing)} of them missing: {shown}; "
                           f"the download is incomplete: {REFETCH}")
    return [index.parent / n for n in names]


def weights_in(folder: Path) -> dict[str, tuple[list[int], Path]] | None:
    """Check every weight file of `folder` (check_weights) and, for safetensors shards, that each
    tensor their index names is in the shard it names (BadModelFile otherwise). Returns each
    tensor's shape and file by name; None where some weights are torch.save files (their names
    are pickled) or there are none."""
    files = weight_files(folder)
    found: dict[str, tuple[list[int], Path]] = {}
    readable = bool(files)
    for file in files:
        shapes = check_weights(file)
        readable = readable and shapes is not None
        found.update({name: (shape, file) for name, shape in (shapes or {}).items()})
    for index in sorted(folder.glob(SAFETENSORS_INDEX)):
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            if name not in found or found[name][1] != index.parent / shard:
                raise BadModelFile(f"{index} places tensor {name} in {shard}, whose header has no such tensor: the "
                                   f"shards are not the ones the index was written with; {REFETCH}")
    return found if readable else None


def check_weights(path: Path) -> dict[str, list[int]] | None:
    """BadModelFile when the file's header says it cannot be whole; else the shape of each
    tensor a safetensors file holds, by name (None for a torch.save file: its names are pickled)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if head.startswith(b"version https://git-lfs"):
            raise BadModelFile(f"{path} is a Git LFS pointer, not the weights: run `git lfs pull` in "
                               f"{path.parent}, or {REFETCH}")
        if path.suffix == ".safetensors":
            return _check_safetensors(path, f, size)
        _check_torch_file(path, head, size)
        return None


def _check_safetensors(path: Path, f, size: int) -> dict[str, list[int]]:
    if size < 8:
        raise BadModelFile(f"{path}: {size} bytes, too short for a safetensors file (truncated?); {REFETCH}")
    f.seek(0)
    length = int.from_bytes(f.read(8), "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise BadModelFile(f"{path}: its header claims {length:,} bytes but the file holds {size:,}: not a "
                           f"safetensors file, or cut short; {REFETCH}")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadModelFile(f"{path}: its header is not JSON: not a safetensors file, or damaged; {REFETCH}") from None
    if not isinstance(header, dict):
        raise BadModelFile(f"{path}: its header is not a JSON object; {REFETCH}")
    data_bytes, shapes = size - 8 - length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape, dtype = [int(n) for n in info["shape"]], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise BadModelFile(f"{path}: tensor {name} has no valid data_offsets/shape/dtype; {REFETCH}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise BadModelFile(f"{path}: tensor {name} lies at bytes {begin:,}-{end:,} of the data, but the file "
                               f"holds {data_bytes:,} bytes of data: it was cut short; {REFETCH}")
        expected = math.prod(shape) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else end - begin
        if end - begin != expected:
            raise BadModelFile(f"{path}: tensor {name} ({dtype} {shape}) needs {expected:,} bytes but its offsets "
                               f"give {end - begin:,}: the header is damaged; {REFETCH}")
        shapes[name] = shape
    return shapes


def _check_torch_file(path: Path, head: bytes, size: int) -> None:
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError) as err:
            raise BadModelFile(f"{path}: a torch.save archive whose end is missing or damaged ({err}): cut "
                               f"short; {REFETCH}") from None
        if not any(n.endswith("data.pkl") for n in names):
            raise BadModelFile(f"{path}: a zip archive, but not one torch.save wrote (no data.pkl); {REFETCH}")
    elif not head.startswith(b"\x80"):
        what = "empty" if size == 0 else f"starts with bytes {head[:8].hex(' ')}"
        raise BadModelFile(f"{path}: neither a torch.save archive nor a pickle ({what}); {REFETCH}")


# --------------------------------------------------------------------------- tokenizer


def tokenizer_problem(folder: Path) -> str | None:
    """Why the folder's tokenizer cannot load (no file to build it from, or a
    tokenizer.json that is not JSON); None when it looks loadable."""
    present = [name for name in TOKENIZER_FILES if any(p.is_file() for p in folder.glob(name))]
    if not present:
        return (f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save it beside the "
                "weights: tokenizer.save_pretrained(folder)")
    if "tokenizer.json" in present:
        try:
            json.loads((folder / "tokenizer.json").read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"{folder / 'tokenizer.json'} is not readable JSON ({err}); save the tokenizer again"
    return None


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer saved in `folder` carries a chat template."""
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
