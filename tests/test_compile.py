"""``--compile``: the drafter's forward under ``torch.compile`` traces without a graph break (the first round on an
empty cache and the later ones on a filled cache), stays a dispatchable ``ReTraceDrafter`` with the same state dict,
and the compiled drafter is lossless."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from transformers import DynamicCache

import hf_retrace  # noqa: F401  (the generate hook)
from hf_retrace.loading import compile_drafter

MAX_NEW = 16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _round_inputs(drafter, cache: DynamicCache, context_rows: int, start: int) -> dict:
    block, features = drafter.config.block_size, len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    return dict(target_hidden=torch.randn(1, context_rows, features, dtype=drafter.dtype),
                noise_embedding=torch.randn(1, block, drafter.config.hidden_size, dtype=drafter.dtype),
                position_ids=torch.arange(start, start + context_rows + block)[None], past_key_values=cache,
                use_cache=True)


def test_the_drafter_forward_has_no_graph_break_on_an_empty_and_a_filled_cache():
    drafter = tiny_drafter(tiny_target(dtype=torch.float32), draft_vocab_size=40)
    cache = DynamicCache()
    first = torch._dynamo.explain(drafter.forward)(**_round_inputs(drafter, cache, 7, 0))
    cache.crop(-drafter.config.block_size)
    later = torch._dynamo.explain(drafter.forward)(**_round_inputs(drafter, cache, 3, 7))
    for explained in (first, later):
        assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
        assert explained.graph_count == 1


def test_a_compiled_drafter_is_still_a_drafter_and_lossless():
    target = tiny_target(dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, draft_vocab_size=60)
    keys = list(drafter.state_dict())
    # backend "eager": dynamo traces the whole forward (fullgraph: a graph break would raise), no C++ compiler needed
    assert compile_drafter(drafter, backend="eager", fullgraph=True) is drafter
    assert type(drafter).__name__ == "ReTraceDrafter" and list(drafter.state_dict()) == keys
    prompt = torch.tensor([[5, 17, 33, 2, 41, 8, 5, 17]])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW, do_sample=False)
    drafted = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert drafter.last_stats.rounds > 1  # the compiled forward really drafted, round after round
    assert torch.equal(drafted, target.generate(prompt, **kwargs))


@pytest.mark.slow  # inductor compiles C++ kernels: about 100 s on two shared CPU cores
def test_the_inductor_compiled_drafter_matches_the_eager_one():
    drafter = tiny_drafter(tiny_target(dtype=torch.float32))
    rows = [5, 3, 1, 4]
    torch.manual_seed(0)
    inputs = [(rows[i], sum(rows[:i]), torch.randn(1, rows[i], 2 * drafter.config.hidden_size)) for i in range(4)]

    def run() -> list[torch.Tensor]:
        cache, outs = DynamicCache(), []
        for count, start, hidden in inputs:
            block = torch.ones(1, drafter.config.block_size, drafter.config.hidden_size)
            outs.append(drafter(target_hidden=hidden, noise_embedding=block, past_key_values=cache, use_cache=True,
                                position_ids=torch.arange(start, start + count + drafter.config.block_size)[None]))
            cache.crop(-drafter.config.block_size)
        return outs

    eager = run()
    compile_drafter(drafter, fullgraph=True)
    for compiled, reference in zip(run(), eager):
        torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)
