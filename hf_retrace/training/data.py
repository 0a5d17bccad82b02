"""Data from the target: prompts in, the target's own answers out, then compact training sequences.

A DFlash drafter is trained on what the *target* says, not on a dataset's reference answers. The pipeline is:

1. :func:`read_prompts` reads prompts from JSONL (``prompt`` / ``question`` / ``problem`` / ``turns`` ...) or a
   ``datasets.Dataset``; :func:`validate_prompt_file` checks a file cheaply before any model is loaded.
2. :func:`generate_responses` lets the target answer them with its own chat template (user turn + generation
   prompt only), batched and left-padded, into resumable JSONL shards ``responses-00000.jsonl`` ... with the
   fields ``id, prompt, response, finish, response_tokens``.
3. :func:`tokenize_responses` turns those records into ``input_ids`` + ``loss_mask`` (1 on response tokens) stored
   as memory-mappable ``.npy`` shards plus a ``manifest.json``; :class:`TokenizedDataset` reads them back.

Example::

    prompts = read_prompts("gsm8k-train.jsonl", suffix="\\nPlease reason step by step.")
    generate_responses(target, tokenizer, prompts, "work_data/responses")
    tokenize_responses(tokenizer, ["work_data/responses"], "work_data/tokenized", max_length=1024)
    dataset = TokenizedDataset("work_data/tokenized")
    dataset[0]["input_ids"], dataset[0]["loss_mask"]
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

PROMPT_FIELDS: tuple[str, ...] = ("prompt", "question", "problem", "turns", "messages", "conversations")
"""Fields a prompt record may carry, in order of preference (``turns``/``messages``/``conversations``: first user
turn)."""

ID_FIELDS: tuple[str, ...] = ("id", "question_id", "task_id", "unique_id")
RESPONSE_FIELDS: tuple[str, ...] = ("id", "prompt", "response", "finish", "response_tokens")
RESPONSE_SHARD_GLOB = "responses-*.jsonl"
_PARTIAL_SUFFIX = ".partial"
_SENTINEL = "\u2063RETRACE_SENTINEL\u2063"


# ---------------------------------------------------------------------------------------------------------------
# 1. Prompts
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptRecord:
    """One prompt to send to the target: a stable ``id`` (for resuming) and the user-turn text."""

    id: str
    prompt: str


def _first_user_turn(turns: Any) -> str | None:
    """The first user message of ``turns`` (a list of strings, of ``{role, content}`` or of ``{from, value}``)."""
    if not isinstance(turns, (list, tuple)) or not turns:
        return None
    for turn in turns:
        if isinstance(turn, str):
            return turn
        if isinstance(turn, Mapping):
            role = turn.get("role", turn.get("from"))
            if role in ("user", "human"):
                text = turn.get("content", turn.get("value"))
                return text if isinstance(text, str) else None
    return None


def _prompt_text(record: Mapping[str, Any]) -> str | None:
    """The prompt text of one record, from the first field of :data:`PROMPT_FIELDS` it carries."""
    for field in PROMPT_FIELDS:
        if field not in record:
            continue
        value = record[field]
        return value if isinstance(value, str) else _first_user_turn(value)
    return None


def _record_id(record: Mapping[str, Any], fallback: str) -> str:
    for field in ID_FIELDS:
        if record.get(field) is not None:
            return str(record[field])
    return fallback


def _missing_fields_error(where: str, records: Sequence[Mapping[str, Any]]) -> ValueError:
    found = sorted({key for record in records for key in record})
    return ValueError(
        f"{where}: no prompt field found. Fields found: {found}; expected one of {list(PROMPT_FIELDS)} "
        "(turns/messages/conversations: the first user turn is used). Rename the field or convert the file."
    )


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line; a line that is not a JSON object is a ValueError."""
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg}).") from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}.")
            yield line_number, record


def validate_prompt_file(path: str | os.PathLike[str], num_records: int = 8) -> str:
    """Check cheaply that ``path`` is JSONL whose first records carry a prompt field; return that field's name.

    Raises ``FileNotFoundError`` or a ``ValueError`` that names the fields found and those expected, so a CLI can
    fail before loading any model.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Prompt file not found: {path}")
    head: list[dict[str, Any]] = []
    for _, record in _iter_jsonl(path):
        head.append(record)
        if len(head) >= num_records:
            break
    if not head:
        raise ValueError(f"{path}: the file holds no records; expected JSONL with one of {list(PROMPT_FIELDS)}.")
    for record in head:
        for field in PROMPT_FIELDS:
            if field in record and _prompt_text(record) is not None:
                return field
    raise _missing_fields_error(f"{path} (first {len(head)} records)", head)


def _raw_prompt_records(source: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(fallback id, record) pairs from a JSONL path, a ``datasets.Dataset`` or any iterable of mappings."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        validate_prompt_file(path)
        for line_number, record in _iter_jsonl(path):
            yield f"{path.stem}-{line_number}", record
        return
    # a datasets.Dataset (duck-typed, so `datasets` stays an optional extra) or a plain list of dicts
    for row_index, record in enumerate(source):
        if not isinstance(record, Mapping):
            raise ValueError(f"Prompt record {row_index} is a {type(record).__name__}; expected a mapping.")
        yield str(row_index), record


def read_prompts(
    path_or_dataset: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    limit: int | None = None,
    *,
    suffix: str = "",
) -> list[PromptRecord]:
    """Read prompts from a JSONL file, a ``datasets.Dataset`` or an iterable of dicts.

    The prompt comes from the first field of :data:`PROMPT_FIELDS` present (for multi-turn records, the first user
    turn). The id comes from ``id``/``question_id``/``task_id``/``unique_id``, else ``<file stem>-<line number>``
    (or the row index). ``suffix`` is appended to every prompt (e.g. the DFlash GSM8K/MATH instruction).

    Example::

        prompts = read_prompts("data/train/gsm8k-train.jsonl", limit=64)
    """
    prompts: list[PromptRecord] = []
    seen: set[str] = set()
    for fallback_id, record in _raw_prompt_records(path_or_dataset):
        if limit is not None and len(prompts) >= limit:
            break
        text = _prompt_text(record)
        record_id = _record_id(record, fallback_id)
        if text is None:
            raise _missing_fields_error(f"prompt record {record_id!r}", [record])
        if record_id in seen:
            raise ValueError(f"Duplicate prompt id {record_id!r}: ids must be unique for resumable generation.")
        seen.add(record_id)
        prompts.append(PromptRecord(id=record_id, prompt=text + suffix))
    return prompts


# ---------------------------------------------------------------------------------------------------------------
# Chat template helpers (shared by generation and tokenization, so both see exactly the same prompt tokens)
# ---------------------------------------------------------------------------------------------------------------


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """The user turn plus the generation prompt, as text, in the tokenizer's chat template.

    ``enable_thinking=False`` is always passed: templates that know it (Qwen3) turn thinking off, the others ignore
    it. A tokenizer without a chat template gets the raw prompt.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return prompt
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def prompt_token_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of :func:`render_prompt` for each prompt (special tokens come from the template itself)."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if not prompts:
        return []
    texts = [render_prompt(tokenizer, prompt) for prompt in prompts]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=not has_template)["input_ids"]]


def end_of_turn_token_id(tokenizer: Any) -> int:
    """The token that closes an assistant turn in the chat template (e.g. ``<|im_end|>``, ``<|eot_id|>``).

    Found by rendering a sentinel answer and taking the first token after it when that token is special; otherwise
    (no template, or plain text after the answer) the tokenizer's ``eos_token_id``.
    """
    if getattr(tokenizer, "chat_template", None) is not None:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=False)
        if _SENTINEL in rendered:
            after = rendered.split(_SENTINEL, 1)[1]
            ids = tokenizer(after, add_special_tokens=False)["input_ids"]
            if ids and tokenizer.decode(ids[:1], skip_special_tokens=True) == "":
                return int(ids[0])
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has neither a chat template that closes assistant turns nor an eos token.")
    return int(tokenizer.eos_token_id)


def split_matches_full_render(tokenizer: Any, prompt: str, response: str) -> bool:
    """Whether prompt tokens + ``tokenizer(response)`` + end-of-turn equal the tokens of the full rendered chat.

    The training sequences are built by concatenation (:func:`tokenize_responses`); this reports whether that is
    what the tokenizer would give for the whole conversation rendered at once.
    """
    ours = prompt_token_ids(tokenizer, [prompt])[0]
    ours += tokenizer(response, add_special_tokens=False)["input_ids"] + [end_of_turn_token_id(tokenizer)]
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    full_text = tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=False)
    full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    return list(full[: len(ours)]) == ours


# ---------------------------------------------------------------------------------------------------------------
# 2. Responses from the target
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GenerationSummary:
    """What one :func:`generate_responses` call did; ``tokens_per_second`` counts generated tokens (eos included)."""

    num_prompts: int
    num_already_done: int
    num_too_long: int
    num_generated: int
    new_tokens: int
    seconds: float
    shards: list[Path]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _read_jsonl_tolerant(path: Path) -> list[dict[str, Any]]:
    """Records of a shard being written; a truncated last line (a kill mid-write) is dropped."""
    records: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for index, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                raise ValueError(f"{path}:{index + 1}: corrupt line in the middle of a shard.") from None
            logger.warning("%s: dropping a truncated last line (interrupted write).", path)
    return records


def response_shards(out_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete response shards in ``out_dir``, in order (the ``.partial`` shard being written is excluded)."""
    return sorted(Path(out_dir).glob(RESPONSE_SHARD_GLOB))


class _ResponseShardWriter:
    """Appends records to ``responses-NNNNN.jsonl.partial`` (flushed per batch), renamed when complete.

    A kill loses at most the batch being written: complete lines of the partial shard are kept on resume, a
    truncated last line is dropped, and complete shards are only ever produced by an atomic rename.
    """

    def __init__(self, out_dir: Path, shard_size: int) -> None:
        self.out_dir = out_dir
        self.shard_size = shard_size
        out_dir.mkdir(parents=True, exist_ok=True)
        self.done_ids: set[str] = set()
        for shard in response_shards(out_dir):
            self.done_ids.update(str(record["id"]) for _, record in _iter_jsonl(shard))
        partials = sorted(out_dir.glob(RESPONSE_SHARD_GLOB + _PARTIAL_SUFFIX))
        if len(partials) > 1:
            raise ValueError(f"{out_dir}: several partial shards {partials}; expected at most one.")
        self.partial_records = _read_jsonl_tolerant(partials[0]) if partials else []
        self.done_ids.update(str(record["id"]) for record in self.partial_records)
        self.index = self._next_index()
        if partials:
            partials[0].rename(self._partial_path)  # keep its records under the next free index
            self._rewrite_partial()  # without the truncated line, so appends start on a clean line

    def _next_index(self) -> int:
        shards = response_shards(self.out_dir)
        return int(shards[-1].name[len("responses-") : -len(".jsonl")]) + 1 if shards else 0

    @property
    def _partial_path(self) -> Path:
        return self.out_dir / f"responses-{self.index:05d}.jsonl{_PARTIAL_SUFFIX}"

    def _rewrite_partial(self) -> None:
        temporary = self._partial_path.with_suffix(".tmp")
        with temporary.open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in self.partial_records)
        temporary.replace(self._partial_path)

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        """Append one batch (one write, flushed and fsynced), promoting the shard whenever it fills up."""
        remaining = list(records)
        while remaining:
            room = self.shard_size - len(self.partial_records)
            chunk, remaining = remaining[:room], remaining[room:]
            with self._partial_path.open("a", encoding="utf-8") as handle:
                handle.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in chunk))
                handle.flush()
                os.fsync(handle.fileno())
            self.partial_records += chunk
            self.done_ids.update(str(record["id"]) for record in chunk)
            if len(self.partial_records) >= self.shard_size:
                self.close()

    def close(self) -> None:
        """Promote the partial shard to a complete one (atomic rename); an empty one is removed."""
        if self.partial_records:
            self._partial_path.replace(self.out_dir / f"responses-{self.index:05d}.jsonl")
            self.index += 1
            self.partial_records = []
        else:
            self._partial_path.unlink(missing_ok=True)


def _eos_token_ids(target: Any, tokenizer: Any) -> set[int]:
    """Ids that end generation: the target's generation config, the template's end of turn and the tokenizer's eos."""
    ids: set[int] = set()
    configured = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    ids.add(end_of_turn_token_id(tokenizer))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` (padding on the left so every row ends at the same column)."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            input_ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            attention_mask[row, width - len(sequence) :] = 1
    return input_ids, attention_mask


def _split_at_eos(new_tokens: Sequence[int], eos_ids: set[int]) -> tuple[list[int], str]:
    """The response tokens before the first eos, and ``"eos"`` or ``"length"``."""
    for position, token in enumerate(new_tokens):
        if token in eos_ids:
            return list(new_tokens[:position]), "eos"
    return list(new_tokens), "length"


def _batch_plan(prompt_lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped into batches of similar length (longest first, so memory peaks early)."""
    order = sorted(range(len(prompt_lengths)), key=lambda index: (-prompt_lengths[index], index))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


@torch.inference_mode()
def _generate_batch(
    target: Any,
    sequences: Sequence[Sequence[int]],
    pad_token_id: int,
    generation_kwargs: dict[str, Any],
) -> list[list[int]]:
    """New tokens (padding included) for each left-padded prompt of the batch."""
    input_ids, attention_mask = _left_pad(sequences, pad_token_id)
    device = getattr(target, "device", torch.device("cpu"))
    output = target.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        pad_token_id=pad_token_id,
        **generation_kwargs,
    )
    return output[:, input_ids.shape[1] :].tolist()


def generate_responses(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[PromptRecord],
    out_dir: str | os.PathLike[str],
    *,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    shard_size: int = 1024,
    max_prompt_tokens: int = 768,
) -> GenerationSummary:
    """Let the target answer ``prompts`` with its own chat template; write resumable JSONL shards to ``out_dir``.

    Each record is ``{id, prompt, response, finish, response_tokens, response_ids}`` (``finish`` is ``"eos"`` or
    ``"length"``; ``response_tokens`` counts the response's tokens, the eos excluded; ``response_ids`` are the exact
    tokens generated, which decoding and re-tokenizing does not always give back). Prompts are sorted by length and
    cut into fixed batches (left-padded); ids already present in ``out_dir`` are skipped, so a killed run is resumed by
    calling again with the same arguments and loses at most one batch. Batch ``k`` of the plan samples with seed
    ``seed + k``, so a resumed sampled run equals an uninterrupted one. Prompts over ``max_prompt_tokens`` tokens
    are skipped.

    Example::

        summary = generate_responses(target, tokenizer, read_prompts("prompts.jsonl"), "work_data/responses")
        print(summary.tokens_per_second)
    """
    from tqdm.auto import tqdm

    writer = _ResponseShardWriter(Path(out_dir), shard_size)
    token_ids = prompt_token_ids(tokenizer, [record.prompt for record in prompts])
    too_long = {index for index, ids in enumerate(token_ids) if len(ids) > max_prompt_tokens}
    if too_long:
        logger.warning("Skipping %d prompts longer than %d tokens.", len(too_long), max_prompt_tokens)
    eos_ids = _eos_token_ids(target, tokenizer)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    generation_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "do_sample": do_sample, "eos_token_id": sorted(eos_ids)
    }
    if do_sample:
        generation_kwargs.update(temperature=temperature, top_p=top_p)
    else:  # keep a checkpoint's sampling defaults from leaking into greedy decoding
        generation_kwargs.update(temperature=None, top_p=None, top_k=None)

    lengths = [len(ids) for ids in token_ids]
    num_already_done = sum(record.id in writer.done_ids for record in prompts)
    todo_count = sum(i not in too_long and r.id not in writer.done_ids for i, r in enumerate(prompts))
    new_tokens, num_generated, start = 0, 0, time.perf_counter()
    progress = tqdm(total=todo_count, desc="target responses", unit="prompt")
    for batch_index, batch in enumerate(_batch_plan(lengths, batch_size)):
        todo = [i for i in batch if i not in too_long and prompts[i].id not in writer.done_ids]
        if not todo:
            continue
        torch.manual_seed(seed + batch_index)
        outputs = _generate_batch(target, [token_ids[i] for i in todo], pad_token_id, generation_kwargs)
        records = []
        for index, generated in zip(todo, outputs):
            response_ids, finish = _split_at_eos(generated, eos_ids)
            new_tokens += len(response_ids) + (finish == "eos")
            records.append(
                {
                    "id": prompts[index].id,
                    "prompt": prompts[index].prompt,
                    "response": tokenizer.decode(response_ids, skip_special_tokens=True),
                    "finish": finish,
                    "response_tokens": len(response_ids),
                    "response_ids": response_ids,
                }
            )
        writer.append(records)
        num_generated += len(records)
        progress.update(len(records))
        progress.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
    progress.close()
    writer.close()
    return GenerationSummary(
        num_prompts=len(prompts),
        num_already_done=num_already_done,
        num_too_long=len(too_long),
        num_generated=num_generated,
        new_tokens=new_tokens,
        seconds=time.perf_counter() - start,
        shards=response_shards(out_dir),
    )


def read_responses(paths: Iterable[str | os.PathLike[str]]) -> Iterator[dict[str, Any]]:
    """Response records from JSONL files and/or directories of complete ``responses-*.jsonl`` shards, in order."""
    for path in map(Path, paths):
        files = response_shards(path) if path.is_dir() else [path]
        for file in files:
            for line_number, record in _iter_jsonl(file):
                missing = [field for field in ("prompt", "response", "finish") if field not in record]
                if missing:
                    raise ValueError(
                        f"{file}:{line_number}: response record lacks {missing}; fields found: {sorted(record)}; "
                        f"expected {list(RESPONSE_FIELDS)} (the output format of generate_responses)."
                    )
                yield record


# ---------------------------------------------------------------------------------------------------------------
# 3. Training sequences
# ---------------------------------------------------------------------------------------------------------------

_MANIFEST = "manifest.json"
_SHARD_ARRAYS = ("input_ids", "loss_mask", "offsets")


def build_sequence(
    tokenizer: Any,
    prompt: str,
    response: str,
    finish: str,
    *,
    max_length: int,
    end_of_turn_id: int | None = None,
    response_ids: Sequence[int] | None = None,
) -> tuple[list[int], list[int]] | None:
    """``(input_ids, loss_mask)`` for one answer: the chat prompt (mask 0), then the response (+ end of turn) (mask 1).

    The prompt is rendered with the chat template and the response tokenized on its own with
    ``add_special_tokens=False`` (or taken from ``response_ids``, the exact generated tokens, when given); the
    end-of-turn token is appended when ``finish == "eos"``. The sequence is cut at
    ``max_length``; ``None`` when nothing of the response fits (or the response is empty and was cut by length).
    """
    prompt_ids = prompt_token_ids(tokenizer, [prompt])[0]
    if response_ids is None:
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    response_ids = list(response_ids)
    if finish == "eos":
        response_ids.append(end_of_turn_token_id(tokenizer) if end_of_turn_id is None else end_of_turn_id)
    input_ids = (prompt_ids + response_ids)[:max_length]
    loss_mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_length]
    if not any(loss_mask):
        return None
    return input_ids, loss_mask


def _shard_stem(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}"


def _write_shard(
    stem: Path, sequences: Sequence[tuple[list[int], list[int]]], ids: Sequence[str], num_skipped: int
) -> dict[str, Any]:
    """Write one shard's flat arrays (each via a temp file + rename); return its manifest entry."""
    lengths = np.array([len(input_ids) for input_ids, _ in sequences], dtype=np.int64)
    arrays = {
        "input_ids": np.fromiter((t for s, _ in sequences for t in s), dtype=np.int32, count=int(lengths.sum())),
        "loss_mask": np.fromiter((m for _, s in sequences for m in s), dtype=np.uint8, count=int(lengths.sum())),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }
    for name, array in arrays.items():
        temporary = stem.with_name(f"{stem.name}.{name}.tmp.npy")
        np.save(temporary, array)
        temporary.replace(stem.with_name(f"{stem.name}.{name}.npy"))
    ids_path = stem.with_name(f"{stem.name}.ids.json")
    ids_path.with_suffix(".tmp").write_text(json.dumps(list(ids)), encoding="utf-8")
    ids_path.with_suffix(".tmp").replace(ids_path)
    return {
        "name": stem.name,
        "num_sequences": len(sequences),
        "num_tokens": int(lengths.sum()),
        "num_response_tokens": int(arrays["loss_mask"].sum()),
        "num_skipped": num_skipped,
    }


def _tokenization_settings(
    tokenizer: Any, paths: Sequence[Path], max_length: int, shard_size: int
) -> dict[str, Any]:
    sources = []
    for path in paths:
        files = response_shards(path) if path.is_dir() else [path]
        sources += [{"path": str(file.resolve()), "bytes": file.stat().st_size} for file in files]
    return {
        "tokenizer": str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
        "vocab_size": len(tokenizer),
        "end_of_turn_token_id": end_of_turn_token_id(tokenizer),
        "max_length": max_length,
        "shard_size": shard_size,
        "sources": sources,
    }


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    temporary = out_dir / (_MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    temporary.replace(out_dir / _MANIFEST)


def _chunks(records: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_responses(
    tokenizer: Any,
    responses_jsonl_paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    max_length: int = 1024,
    shard_size: int = 8192,
) -> dict[str, Any]:
    """Turn response records into training sequences stored as memory-mappable shards; return the manifest.

    Inputs are JSONL files or directories written by :func:`generate_responses` (records ``{id, prompt, response,
    finish}``; a record's ``response_ids``, when present, are used instead of re-tokenizing ``response``). Shard
    ``k`` holds the sequences of source records ``k*shard_size ... (k+1)*shard_size - 1``:
    ``shard-0000k.input_ids.npy`` (int32, flat), ``.loss_mask.npy`` (uint8, flat), ``.offsets.npy`` (int64,
    ``num_sequences + 1``) and ``.ids.json``. ``manifest.json`` holds the settings, the per-shard counts and the
    totals; it is rewritten after each shard, so a second call resumes after the last complete shard, and returns
    at once when ``complete`` is true. Settings that differ from an existing manifest are a ``ValueError``.

    Example::

        manifest = tokenize_responses(tokenizer, ["responses.jsonl"], "work_data/tokenized", max_length=1024)
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    paths = [Path(path) for path in responses_jsonl_paths]
    settings = _tokenization_settings(tokenizer, paths, max_length, shard_size)
    manifest: dict[str, Any] = {**settings, "complete": False, "shards": []}
    if (out_dir / _MANIFEST).exists():
        existing = json.loads((out_dir / _MANIFEST).read_text(encoding="utf-8"))
        changed = [key for key in settings if existing.get(key) != settings[key]]
        if changed:
            raise ValueError(
                f"{out_dir} already holds sequences made with other settings ({changed} differ). "
                "Use a new output folder, or delete this one to re-tokenize."
            )
        if existing.get("complete"):
            return existing
        manifest["shards"] = [
            shard for shard in existing["shards"]
            if all((out_dir / f"{shard['name']}.{array}.npy").exists() for array in _SHARD_ARRAYS)
        ]
    out_dir.mkdir(parents=True, exist_ok=True)
    end_of_turn_id = settings["end_of_turn_token_id"]
    done_shards = len(manifest["shards"])
    for index, chunk in enumerate(tqdm(_chunks(read_responses(paths), shard_size), desc="tokenize", unit="shard")):
        if index < done_shards:
            continue
        sequences, ids, num_skipped = [], [], 0
        for record in chunk:
            sequence = build_sequence(
                tokenizer, record["prompt"], record["response"], record["finish"],
                max_length=max_length, end_of_turn_id=end_of_turn_id, response_ids=record.get("response_ids"),
            )
            if sequence is None:
                num_skipped += 1
                continue
            sequences.append(sequence)
            ids.append(str(record.get("id", "")))
        manifest["shards"].append(_write_shard(_shard_stem(out_dir, index), sequences, ids, num_skipped))
        _write_manifest(out_dir, manifest)
    for total in ("num_sequences", "num_tokens", "num_response_tokens", "num_skipped"):
        manifest[total] = sum(shard[total] for shard in manifest["shards"])
    manifest["complete"] = True
    _write_manifest(out_dir, manifest)
    return manifest


class TokenizedDataset(torch.utils.data.Dataset):
    """Training sequences written by :func:`tokenize_responses`, read from memory-mapped shards.

    Example::

        dataset = TokenizedDataset("work_data/smollm2-tokenized")
        item = dataset[0]  # {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        manifest_path = self.directory / _MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"No {_MANIFEST} in {self.directory}; run tokenize_responses first.")
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.directory} is only partly tokenized; run tokenize_responses again to finish it.")
        self._shards = [
            {name: np.load(self.directory / f"{shard['name']}.{name}.npy", mmap_mode="r") for name in _SHARD_ARRAYS}
            for shard in self.manifest["shards"]
        ]
        counts = [len(shard["offsets"]) - 1 for shard in self._shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def sequence_lengths(self) -> np.ndarray:
        """Token count of every sequence (for length-grouped batching)."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.diff(shard["offsets"]) for shard in self._shards])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        shard_index = int(np.searchsorted(self._starts, index, side="right")) - 1
        shard = self._shards[shard_index]
        row = index - int(self._starts[shard_index])
        begin, end = int(shard["offsets"][row]), int(shard["offsets"][row + 1])
        return {
            "input_ids": torch.from_numpy(np.array(shard["input_ids"][begin:end], dtype=np.int64)),
            "loss_mask": torch.from_numpy(np.array(shard["loss_mask"][begin:end], dtype=np.bool_)),
        }
