"""Fixtures shared by the tests (the helpers they import are in ``helpers.py``)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from helpers import ProposalPolicy

from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator

# tiny models: one intra-op thread is fastest, and stays fast when another job holds the second core
torch.set_num_threads(1)


@pytest.fixture
def use_policy(monkeypatch):
    """Install a ProposalPolicy on every ReTraceCandidateGenerator created during the test."""

    def install(policy: ProposalPolicy):
        original = ReTraceCandidateGenerator._propose

        def propose(self, input_ids, logits):
            tokens, processed = original(self, input_ids, logits)
            tokens = policy(input_ids, tokens.shape[1]).to(tokens.device)
            if self.sampled_proposals:  # the returned proposal law must be the one the drafts came from: certain
                processed = torch.full_like(processed, float("-inf"))
                processed[0, torch.arange(tokens.shape[1]), tokens[0]] = 0.0
            return tokens, processed

        monkeypatch.setattr(ReTraceCandidateGenerator, "_propose", propose)

    return install


@pytest.fixture
def count_forwards():
    """Count calls of a module's forward: ``counter = count_forwards(model)``, then ``counter["n"]``."""
    handles = []

    def attach(module):
        counter = {"n": 0}
        handles.append(module.register_forward_pre_hook(lambda *_: counter.__setitem__("n", counter["n"] + 1)))
        return counter

    yield attach
    for handle in handles:
        handle.remove()
