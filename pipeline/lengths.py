"""How many tokens a stage's rows hold, from a sample of its data: what the plan's
time per step is computed from (how rows pack, how much is padding, attention by
each sequence's own length) instead of assuming every row max_len long.

Torch-free (it runs on login nodes) and cheap: at most SAMPLE_ROWS rows are read —
a random sample of a local .jsonl/.json/.csv/.parquet file (large .jsonl files by
seeking to random places), of a dataset folder or a hub dataset already in the
cache (their Arrow files, memory-mapped), or builtin:digits, generated as the
stages generate it. Tokens are counted as the stages count them (stages/data.py:
the prompt with the tokenizer's special tokens, each response without, plus an
eos) with the model's tokenizer.json through the `tokenizers` library when the
model (or the first model a `from` chain starts at) is on this machine, else as
characters / 4. Chat templates add a few tokens per message that are not counted.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core import kinds
from core.errors import InvalidInput
from core.rows import is_row_file, read_rows
from core.shapes import BUILTIN_PREFIX, cached_config
from pipeline.hfcache import HFCache

SAMPLE_ROWS = 1000
FULL_READ_BYTES = 32 * 2**20  # files up to this size are read whole and sampled; larger .jsonl by seeking
WHOLE_FILE_LIMIT = 256 * 2**20  # .json and .csv cannot be read in part: larger ones are not sampled
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class RowLengths:
    """Token counts of a sample of rows: each row's sequences (SFT one; RM and DPO
    prompt + chosen, prompt + rejected), before truncation to max_len. `rows` is
    empty when the data could not be read here; `source` says why."""

    rows: tuple[tuple[int, ...], ...]
    source: str  # where the rows came from, or why there are none
    counter: str = ""  # how tokens were counted

    @property
    def sampled(self) -> bool:
        return bool(self.rows)

    def describe(self) -> str:
        return f"{self.source}, {self.counter}" if self.sampled else f"max_len assumed per row: {self.source}"


def sample(data, kind: str, model: str, cache: HFCache | None = None, limit: int = SAMPLE_ROWS,
           seed: int = 0) -> RowLengths:
    """Token counts of up to `limit` rows of a stage's data (`data`: its DataSpec); a hub
    model's tokenizer and a hub dataset are looked for in `cache` (none: not looked for)."""
    rng = random.Random(seed)
    rows, source = _sample_rows(data, limit, rng, cache.datasets if cache else None)
    if not rows:
        return RowLengths((), source)
    count, counter = token_counter(model, cache.hub if cache else None)
    if data.chat_template or kinds.get(kind).rows == "completion" and any(data.messages_key in r for r in rows):
        counter += " (chat template tokens not counted)"
    lengths = _row_lengths(rows, kind, data, count)
    if not lengths:
        return RowLengths((), f"{source}: no row has the columns a {kind} stage reads")
    return RowLengths(tuple(lengths), f"{len(lengths)} rows sampled from {source}", counter)


# --------------------------------------------------------------------------- counting


def token_counter(model: str, hub_cache: Path | None = None) -> tuple[Callable[[list[str], bool], list[int]], str]:
    """(count(texts, special_tokens) -> token counts, what counts them) for a model name."""
    if model == BUILTIN_PREFIX + "tiny-llama":
        from core import tiny  # torch-free; its tokenizer needs only `tokenizers`

        return _counting(tiny.build_core_tokenizer()), "the built-in tiny-llama's character tokenizer"
    path = Path(model).expanduser()
    found = path / "tokenizer.json" if path.is_dir() else None
    if found is None or not found.is_file():
        config = cached_config(model, hub_cache)
        found = config.parent / "tokenizer.json" if config is not None else None
    if found is None or not found.is_file():
        return _by_characters, f"characters / {CHARS_PER_TOKEN} (no tokenizer.json of {model} on this machine)"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return _by_characters, f"characters / {CHARS_PER_TOKEN} (the tokenizers library is not installed)"
    try:
        tokenizer = Tokenizer.from_file(str(found))
    except Exception as err:  # noqa: BLE001 -- a tokenizer this library cannot read: say so, count characters
        return _by_characters, f"characters / {CHARS_PER_TOKEN} ({found} is not readable: {err})"
    return _counting(tokenizer), f"counted with {found}"


def _counting(tokenizer) -> Callable[[list[str], bool], list[int]]:
    def count(texts: list[str], special: bool) -> list[int]:
        return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=special)]

    return count


def _by_characters(texts: list[str], special: bool) -> list[int]:
    return [math.ceil(len(t) / CHARS_PER_TOKEN) + (1 if special else 0) for t in texts]


def _row_lengths(rows: list[dict], kind: str, data, count) -> list[tuple[int, ...]]:
    """Each usable row's sequence lengths, as stages/data.py tokenizes it (before max_len)."""
    text = lambda value: value if isinstance(value, str) else ""  # noqa: E731
    if kinds.get(kind).rows == "completion":
        plain, chats = [], []
        for r in rows:
            if isinstance(r.get(data.prompt_key), str) and isinstance(r.get(data.response_key), str):
                plain.append(r)
            elif isinstance(r.get(data.messages_key), list):
                chats.append(r[data.messages_key])
        prompts = count([r[data.prompt_key] for r in plain], True)
        responses = count([r[data.response_key] for r in plain], False)
        out: list[tuple[int, ...]] = [(p + n + 1,) for p, n in zip(prompts, responses)]  # + eos
        for messages in chats:
            contents = count([text(m.get("content")) for m in messages if isinstance(m, dict)], False)
            turns = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
            out.append((1 + sum(contents) + turns,))  # bos, contents, an eos per assistant turn
        return out
    keys = (data.prompt_key, data.chosen_key, data.rejected_key)
    pairs = [r for r in rows if all(isinstance(r.get(k), str) for k in keys)]
    prompts = count([r[data.prompt_key] for r in pairs], True)
    chosen = count([r[data.chosen_key] for r in pairs], False)
    rejected = count([r[data.rejected_key] for r in pairs], False)
    return [(p + c + 1, p + r + 1) for p, c, r in zip(prompts, chosen, rejected)]


# --------------------------------------------------------------------------- reading


def _sample_rows(data, limit: int, rng: random.Random, datasets_cache: Path | None) -> tuple[list[dict], str]:
    """(up to `limit` rows, where they came from) — or ([], why not)."""
    path = data.path
    if data.is_builtin:
        from core import tiny  # torch-free: generates the rows core/tiny.py writes

        splits = dict(tiny.digits_splits())
        if data.split not in splits:
            return [], f"{path} has no split '{data.split}'"
        return splits[data.split][:limit], f"{path} ({data.split})"  # rows are independent draws
    file = Path(path).expanduser()
    if is_row_file(path):
        if not file.is_file():
            return [], f"{path} is not on this machine"
        if file.suffix in (".json", ".csv") and file.stat().st_size > WHOLE_FILE_LIMIT:
            return [], f"{path} is too large to sample quickly (a .jsonl or .parquet file could be)"
        try:
            return _sample_file(file, limit, rng), str(path)
        except (InvalidInput, OSError, ValueError) as err:  # validate names bad rows; the plan carries on
            return [], f"{path} is not readable here ({str(err).splitlines()[0]})"
    if file.is_dir():
        split_dir = file / data.split
        files = sorted((split_dir if split_dir.is_dir() else file).glob("*.arrow"))
        where = f"the dataset folder {path}"
    else:
        org, _, name = path.rpartition("/")
        folder = (datasets_cache or Path()) / f"{org}___{name}" if org else None
        files = sorted(folder.rglob(f"*-{data.split}*.arrow")) if folder is not None and folder.is_dir() else []
        where = f"the cached hub dataset {path} ({data.split})"
        if not files:
            return [], f"the hub dataset {path} is not in the cache yet (`prepare` fetches it)"
    if not files:
        return [], f"{where} holds no Arrow files"
    try:
        return _sample_arrow(files, limit, rng), where
    except Exception as err:  # noqa: BLE001 -- unreadable here: plan with max_len, and say why
        return [], f"{where} is not readable here ({type(err).__name__}: {err})"


def _sample_file(path: Path, limit: int, rng: random.Random) -> list[dict]:
    if path.suffix == ".jsonl" and path.stat().st_size > FULL_READ_BYTES:
        return _seek_jsonl(path, limit, rng)
    if path.suffix == ".parquet" and path.stat().st_size > FULL_READ_BYTES:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        groups = list(range(parquet.num_row_groups))
        rng.shuffle(groups)
        rows: list[dict] = []
        for group in groups:
            rows += parquet.read_row_group(group).to_pylist()
            if len(rows) >= limit:
                break
        return rng.sample(rows, min(limit, len(rows)))
    rows = read_rows(path)
    return rng.sample(rows, min(limit, len(rows)))


def _seek_jsonl(path: Path, limit: int, rng: random.Random) -> list[dict]:
    """Rows at random places of a large .jsonl file: the first whole line after each of
    `limit` random byte offsets (lines after long lines are a little likelier)."""
    size = path.stat().st_size
    rows, starts = [], set()
    with open(path, "rb") as f:
        for offset in sorted(rng.randrange(size) for _ in range(limit)):
            f.seek(offset)
            f.readline()  # the rest of the line the offset fell in
            start, line = f.tell(), f.readline()
            if start in starts or not line.strip():
                continue
            starts.add(start)
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _sample_arrow(files: list[Path], limit: int, rng: random.Random) -> list[dict]:
    """A random sample of the rows of Arrow stream files (how `datasets` stores them)."""
    import pyarrow as pa

    tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    picks = sorted(rng.sample(range(table.num_rows), min(limit, table.num_rows)))
    return table.take(pa.array(picks, type=pa.int64())).to_pylist()
