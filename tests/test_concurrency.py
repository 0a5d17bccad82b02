"""Concurrent generate calls on one shared target with different drafters: every output equals its sequential run."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import tiny_drafter, tiny_target

from hf_retrace.generation import target_features

THREADS = 8
CALLS = 25


def _drafters(target):
    shapes = [  # block size, ReTrace, adaptive cut, context lookup
        (3, None, None, False),
        (5, "random", None, False),
        (8, "random", 0.3, True),
        (6, None, 0.6, True),
    ]
    drafters = []
    for i, (block, retrace, threshold, lookup) in enumerate(shapes):
        drafter = tiny_drafter(target, block_size=block, retrace=retrace, seed=10 + i)
        drafter.config.draft_confidence_threshold, drafter.config.lookup = threshold, lookup
        drafter.config.lookup_min_ngram = 1
        drafters.append(drafter)
    return drafters


@pytest.mark.parametrize("path", ["model_outputs", "hooks"])
def test_threads_sharing_one_target_match_their_sequential_runs(path, monkeypatch):
    if path == "hooks":  # transformers 4.57's path: forward hooks on the shared target, filtered by thread
        monkeypatch.setattr(target_features, "loop_hands_model_outputs", lambda: False)
    target = tiny_target(seed=11, logit_scale=4.0)
    drafters = _drafters(target)
    prompts = [torch.randint(0, 95, (1, 4 + i % 7), generator=torch.Generator().manual_seed(i)) for i in range(10)]
    jobs = [[(t * CALLS + c) % len(drafters), (t * 7 + c) % len(prompts)] for t in range(THREADS) for c in range(CALLS)]
    sequential = {}
    for d, p in {tuple(job) for job in jobs}:
        sequential[(d, p)] = target.generate(prompts[p], assistant_model=drafters[d], max_new_tokens=20,
                                             do_sample=False).tolist()
    mismatches, errors = [], []
    barrier = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for c in range(CALLS):
                d, p = jobs[t * CALLS + c]
                out = target.generate(prompts[p], assistant_model=drafters[d], max_new_tokens=20, do_sample=False)
                stats = drafters[d].last_stats  # this thread's own call
                if out.tolist() != sequential[(d, p)] or stats.new_tokens != out.shape[1] - prompts[p].shape[1]:
                    mismatches.append((t, c, d, p))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert not mismatches, f"{len(mismatches)} of {THREADS * CALLS} concurrent calls differ: {mismatches[:5]}"
    layers = target_features.decoder_layers(target)  # (transformers 5.x keeps its own output-capturing hooks)
    ours = [hook for layer in layers for hook in layer._forward_hooks.values() if "TargetTap" in hook.__qualname__]
    assert not ours, "the generators' hooks outlived their calls"
