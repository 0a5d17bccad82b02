"""Fixtures shared by the tests (the helpers they import are in ``helpers.py``)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the drafter's own (config) round policy unless a test asks for another: tuning at first use measures the machine and
# writes to the user's cache (tests/test_tuning.py covers it, in a temporary cache folder)
os.environ.setdefault("HF_RETRACE_POLICY", "shipped")

import pytest
import torch
from helpers import ProposalPolicy, scripted_source

from hf_retrace import ReTraceDrafter

# tiny models: one intra-op thread is fastest, and stays fast when another job holds the second core
torch.set_num_threads(1)


@pytest.fixture
def use_policy(monkeypatch):
    """Every drafter of the test proposes a ProposalPolicy's tokens: the policy is injected as the drafters' source
    (their ``drafter_source`` hook); for one drafter alone: ``drafter.with_drafter_source(scripted_source(p))``."""

    def install(policy: ProposalPolicy):
        monkeypatch.setattr(ReTraceDrafter, "drafter_source", scripted_source(policy))

    return install


@pytest.fixture
def use_dispatch():
    """Install the global dispatch with a test's own dependencies, ``use_dispatch(resolver=..., observer=...)`` (the
    one not named keeps the installed one); the dispatch ``import hf_retrace`` installed is put back afterwards."""
    from hf_retrace.generation import dispatch

    installed = dispatch.installed()

    def install(**dependencies):
        assert dispatch.install(**{"resolver": installed.resolver, "observer": installed.observer, **dependencies})

    yield install
    dispatch.install(resolver=installed.resolver, observer=installed.observer)


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


# --- the `slow` marker: `python -m pytest -q -m "not slow"` is the quick subset (under 2 minutes on 2 cores); CI runs
# everything. Marked here, in one place, with the reason. A test module may also mark itself (@pytest.mark.slow).
SLOW_MODULES = {
    "test_sampling_law.py": "chi-squared batteries over thousands of sampled answers (~4 min)",
    "test_concurrency.py": "threads sharing one target, each call repeated alone (~100 s)",
    "test_memory.py": "RSS over 100 calls and a 4,000-token generation",
    "test_distributed.py": "two training processes under accelerate",
    "test_demo_server.py": "Gradio servers",
    "test_demo_browser.py": "a real browser",
    "test_processor_audit.py": "every logits processor of transformers, each against plain generate (~20 s)",
    "test_compile.py": "torch.compile",
}
SLOW_TESTS = {  # module -> test names (parameters ignored)
    "test_kwargs_fuzz.py": {"test_long_generation_equals_plain"},  # 2,500 new tokens
    "test_round_shape.py": {"test_a_round_never_copies_a_weight_sized_tensor"},  # a large target on purpose
    "test_generate_surface.py": {"test_opt_in_attach_detach_without_global_patch",  # a subprocess
                                 "test_last_stats_are_per_thread"},  # threads
    "test_checkpoints.py": {"test_hub_id_loads_from_local_cache_offline"},  # a subprocess
    "test_bench_datasets.py": {"test_module_is_pure"},  # a subprocess
    "test_demo.py": {"test_demo_module_imports_cheaply_and_cli_rejects_bad_drafter"},  # a subprocess
    "test_tuning.py": {"test_two_concurrent_writers_leave_one_valid_file"},  # two processes (~30 s)
    "test_device_flags.py": {"test_generate_runs_with_a_device_and_a_compiled_drafter"},  # torch.compile
    "test_recipes.py": {"test_the_data_recipe_splits_rounds_over_workers_and_counts_every_folder"},  # bash rounds
}
SLOW_FIXTURES = {  # module -> fixtures: a test that uses one of them (directly or through another fixture) is slow
    "test_demo.py": {"server"},  # a Gradio server
    "test_bench.py": {"report"},  # a benchmark run over every dataset and method
    "test_training_data.py": {"tokenizer"},  # SmolLM2's tokenizer, read from its GGUF (~10 s)
    "test_conversations.py": {"tokenizer"},  # the same
    "test_training.py": {"counting_target"},  # a tiny target trained first, then drafters trained on it
}
QUICK_CASES = 50  # the first cases of the randomized losslessness suites stay in the quick subset
CASE_SUITES = {"test_kwargs_fuzz.py": "test_kwargs_case",
               "test_greedy_equality.py": "test_greedy_output_equals_plain_greedy"}


def _is_slow(item: pytest.Item) -> bool:
    module = item.path.name
    name = getattr(item, "originalname", item.name)
    if module in SLOW_MODULES or name in SLOW_TESTS.get(module, ()):
        return True
    if SLOW_FIXTURES.get(module, set()) & set(getattr(item, "fixturenames", ())):
        return True
    if CASE_SUITES.get(module) == name:
        return item.callspec.params["index"] >= QUICK_CASES
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
