"""Memory stays flat: over 100 generate calls with one drafter, and over one 4,000-token generation (RSS measured)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_target

from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator

STATUS = Path("/proc/self/status")
pytestmark = pytest.mark.skipif(not STATUS.exists(), reason="RSS is read from /proc/self/status (Linux only)")


def _rss_mib() -> float:
    gc.collect()
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _live_generators() -> int:
    gc.collect()
    return sum(isinstance(obj, ReTraceCandidateGenerator) for obj in gc.get_objects())


def _hybrid_drafter(target):
    drafter = tiny_drafter(target, block_size=6, retrace="random", seed=3)
    drafter.config.draft_confidence_threshold, drafter.config.lookup = 0.3, True
    return drafter


def test_rss_is_flat_over_100_calls():
    target = tiny_target(seed=21, logit_scale=4.0)
    drafter = _hybrid_drafter(target)
    prompts = [torch.randint(0, 95, (1, 5 + i % 9), generator=torch.Generator().manual_seed(i)) for i in range(10)]

    def call(i):
        target.generate(prompts[i % 10], assistant_model=drafter, max_new_tokens=48, do_sample=i % 2 == 1)

    for i in range(20):  # allocator pools and lazy imports settle first
        call(i)
    before = _rss_mib()
    for i in range(100):
        call(i)
    after = _rss_mib()
    print(f"RSS before {before:.1f} MiB, after 100 calls {after:.1f} MiB", file=sys.stderr)
    assert _live_generators() == 0, "a call's candidate generator outlived its call"
    assert after - before < 16, f"RSS grew by {after - before:.1f} MiB over 100 calls (before {before:.1f} MiB)"


def test_rss_over_one_4000_token_generation_is_its_caches():
    """A 4,000-token answer holds the target's and the drafter's caches, nothing per round beyond a few counters."""
    target = tiny_target(seed=22, logit_scale=4.0, max_position_embeddings=4200)
    drafter = _hybrid_drafter(target)
    prompt = torch.randint(0, 95, (1, 8), generator=torch.Generator().manual_seed(5))
    target.generate(prompt, assistant_model=drafter, max_new_tokens=200, do_sample=False)  # warm-up
    before = _rss_mib()
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=4000, min_new_tokens=4000,
                          do_sample=False)
    peak_after = _rss_mib()
    assert out.shape[1] == 8 + 4000
    assert drafter.last_stats.new_tokens == 4000
    # float64 K/V of 4,008 positions: target 4 layers + drafter 1 layer, 2 heads x 16 dims, keys and values
    caches_mib = 4008 * (4 + 1) * 2 * 2 * 16 * 8 / 2**20
    print(f"RSS before {before:.1f} MiB, after a 4,000-token call {peak_after:.1f} MiB (caches {caches_mib:.1f} MiB)",
          file=sys.stderr)
    assert _live_generators() == 0
    assert peak_after - before < 16 + 3 * caches_mib, f"RSS grew by {peak_after - before:.1f} MiB"
