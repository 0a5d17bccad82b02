"""Data from the target: prompts in, the target's own answers out, then compact training sequences.

A DFlash drafter is trained on what the *target* says, not on a dataset's reference answers. The pipeline is:

1. ``prompts``: :func:`read_prompts` reads prompts from JSONL (``prompt`` / ``question`` / ``problem`` / ``turns``
   ...) or a ``datasets.Dataset``; :func:`validate_prompt_file` checks a file cheaply before any model is loaded.
2. ``responses``: :func:`generate_responses` lets the target answer them with its own chat template
   (``chat_template``: user turn + generation prompt only), batched and left-padded, into resumable JSONL shards
   (``response_shards``: ``responses-00000.jsonl`` ... with the fields ``id, prompt, response, finish,
   response_tokens``).
3. ``sequences``: :func:`tokenize_responses` turns those records into ``input_ids`` + ``loss_mask`` (1 on response
   tokens) stored as memory-mappable ``.npy`` shards plus a ``manifest.json``; :class:`TokenizedDataset` reads them.

Example::

    prompts = read_prompts("gsm8k-train.jsonl", suffix="\\nPlease reason step by step.")
    generate_responses(target, tokenizer, prompts, "work_data/responses")
    tokenize_responses(tokenizer, ["work_data/responses"], "work_data/tokenized", max_length=1024)
    dataset = TokenizedDataset("work_data/tokenized")
    dataset[0]["input_ids"], dataset[0]["loss_mask"]
"""

from .chat_template import end_of_turn_token_id, prompt_token_ids, render_prompt, split_matches_full_render
from .prompts import ID_FIELDS, PROMPT_FIELDS, PromptRecord, read_prompts, records_token_ids, validate_prompt_file
from .response_shards import RESPONSE_FIELDS, RESPONSE_SHARD_GLOB, read_responses, response_shards
from .responses import GenerationSummary, generate_responses
from .sequences import TokenizedDataset, build_sequence, tokenize_responses

__all__ = [
    "GenerationSummary",
    "ID_FIELDS",
    "PROMPT_FIELDS",
    "PromptRecord",
    "RESPONSE_FIELDS",
    "RESPONSE_SHARD_GLOB",
    "TokenizedDataset",
    "build_sequence",
    "end_of_turn_token_id",
    "generate_responses",
    "prompt_token_ids",
    "read_prompts",
    "read_responses",
    "records_token_ids",
    "render_prompt",
    "response_shards",
    "split_matches_full_render",
    "tokenize_responses",
    "validate_prompt_file",
]
