"""bitsandbytes 8-bit and 4-bit targets (CPU): the drafter is lossless against the quantized target's own greedy
output, and it borrows that target's embeddings and lm_head unquantized (bitsandbytes never quantizes them).

Why exact equality holds for 8-bit (LLM.int8) although verification runs several rows through the int8 matmuls at
once: activations are quantized row by row and multiplied exactly in int8, so a row's result does not depend on the
other rows -- except for *outlier columns*. A column where any row of the batch reaches the outlier threshold (6.0)
is taken out of the int8 product for every row and recomputed in floating point, so a row verified next to an
outlier row gets a slightly different result (~1e-3) than when decoded alone. ``test_int8_rows_are_batch_invariant``
pins down both facts at the layer level, and the equality tests assert that the tiny target has no outliers, the
condition under which multi-row verification is bit-exact. A real LLM with outlier features can therefore see
greedy ties broken differently by any multi-row verification (transformers' stock assistants included): that is
LLM.int8 numerics, not the drafter. 4-bit with fp32 compute dequantizes weights to fp32, so only ordinary float
rounding differs between row counts, as for an unquantized fp32 target.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import DraftLog, ProposalPolicy, scripted_source, tiny_drafter, tiny_target


VOCAB = 96
MAX_NEW = 24
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig's default llm_int8_threshold

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install hf-retrace[quant])")
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402


def _bitsandbytes_runs_on_cpu() -> str | None:
    """None when an int8 and a 4-bit layer run here; otherwise why not."""
    try:
        layer = bnb.nn.Linear8bitLt(16, 8, bias=False, has_fp16_weights=False, threshold=INT8_THRESHOLD)
        layer.weight = bnb.nn.Int8Params(torch.randn(8, 16), requires_grad=False, has_fp16_weights=False)
        layer.eval()(torch.randn(2, 16))
        layer4 = bnb.nn.Linear4bit(16, 8, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        layer4.load_state_dict({"weight": torch.randn(8, 16)})
        layer4.to("cpu")(torch.randn(2, 16))
    except Exception as error:  # noqa: BLE001 - any failure means: this CPU build cannot run bitsandbytes
        return f"{type(error).__name__}: {error}"
    return None


_cpu_problem = _bitsandbytes_runs_on_cpu()
pytestmark = pytest.mark.skipif(
    _cpu_problem is not None, reason=f"bitsandbytes cannot run on this CPU: {_cpu_problem}"
)

QUANTIZATION = {
    "8bit": lambda: BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD),
    "4bit": lambda: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_type="nf4"
    ),
}
QUANTIZED_LAYERS = {"8bit": bnb.nn.Linear8bitLt, "4bit": bnb.nn.Linear4bit}


@pytest.fixture(scope="module", autouse=True)
def quiet_and_one_thread():
    # bitsandbytes logs "inputs will be cast from float32 to float16" on every int8 matmul
    logger = logging.getLogger("bitsandbytes")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    yield
    logger.setLevel(level)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_target(family="llama", seed=0, logit_scale=4.0, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(QUANTIZATION))
def quantized(request, saved_target):
    kind = request.param
    model = AutoModelForCausalLM.from_pretrained(
        saved_target, quantization_config=QUANTIZATION[kind](), device_map="cpu", dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    return kind, model


def _largest_quantized_input(model, kind):
    """Record the largest |activation| entering any quantized linear layer (pre-hooks); returns (record, remove)."""
    record = {"max": 0.0, "calls": 0}

    def hook(module, args):
        record["max"] = max(record["max"], float(args[0].detach().abs().max()))
        record["calls"] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, QUANTIZED_LAYERS[kind])]
    return record, lambda: [h.remove() for h in handles]


def test_the_target_is_really_quantized_and_the_borrowed_modules_are_not(quantized):
    kind, model = quantized
    quantized_layers = [m for m in model.modules() if isinstance(m, QUANTIZED_LAYERS[kind])]
    assert len(quantized_layers) == 7 * model.config.num_hidden_layers  # q k v o gate up down
    if kind == "8bit":
        assert all(m.weight.dtype == torch.int8 for m in quantized_layers)
    else:
        assert all(m.weight.dtype == torch.uint8 for m in quantized_layers)
    log = DraftLog()
    drafter = tiny_drafter(model, block_size=5, dtype=torch.float32).with_drafter_source(scripted_source(log=log))
    model.generate(torch.arange(3, 9)[None], assistant_model=drafter, max_new_tokens=4, do_sample=False)
    source = log.sources[-1]
    lm_head = model.get_output_embeddings()
    for borrowed, cls in ((source.embed_tokens, torch.nn.Embedding), (lm_head, torch.nn.Linear)):
        assert type(borrowed) is cls, f"borrowed {type(borrowed).__name__}, expected a plain {cls.__name__}"
        assert borrowed.weight.dtype == torch.float32 and borrowed.weight.is_floating_point()
    assert source.embed_tokens is model.get_input_embeddings()
    assert source.draft_head[0] is lm_head.weight  # the rounds score with the plain head itself


@pytest.mark.parametrize("policy", ["drafter", "all", "partial"])
def test_quantized_greedy_equals_its_own_greedy(policy, quantized, use_policy):
    kind, model = quantized
    prompt = torch.randint(0, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    if policy != "drafter":  # force multi-token verification: whole blocks, or accepted prefixes
        use_policy(ProposalPolicy(reference, policy, VOCAB, seed=2))
    # the drafter runs in bfloat16 while the target's hidden states are float32: it casts what it reads
    drafter = tiny_drafter(model, block_size=5, retrace="random", dtype=torch.bfloat16)
    fc_inputs = []
    drafter.fc.register_forward_pre_hook(lambda module, args: fc_inputs.append(args[0].dtype))
    record, remove = _largest_quantized_input(model, kind)
    try:
        out = model.generate(prompt, assistant_model=drafter, max_new_tokens=MAX_NEW, do_sample=False)
    finally:
        remove()
    assert out.tolist() == reference.tolist()
    stats = drafter.last_stats
    assert stats.rounds > 0 and stats.new_tokens == MAX_NEW
    if policy == "all":
        assert max(stats.acceptance_lengths) == drafter.config.block_size  # several rows verified at once
    assert fc_inputs and set(fc_inputs) == {torch.bfloat16}
    assert record["calls"] > 0
    if kind == "8bit":
        # the condition for bit-exact multi-row int8 verification (see the module docstring)
        assert record["max"] < INT8_THRESHOLD, f"an activation reached the int8 outlier threshold: {record}"


def test_int8_rows_are_batch_invariant_without_outliers():
    """LLM.int8 at the layer level: a row's output does not depend on its batch, unless another row has an outlier."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False, threshold=INT8_THRESHOLD)
    layer.weight = bnb.nn.Int8Params(torch.randn(32, 64) * 0.1, requires_grad=False, has_fp16_weights=False)
    layer.eval()
    rows = torch.randn(4, 64).clamp(-3, 3)
    alone = torch.cat([layer(rows[i : i + 1].clone()) for i in range(4)])
    assert torch.equal(layer(rows.clone()), alone)  # several rows at once == one at a time, bit for bit
    with_outlier = rows.clone()
    with_outlier[0, 5] = 2 * INT8_THRESHOLD  # row 0 now has an outlier in column 5
    batched = layer(with_outlier)
    assert not torch.equal(batched[1:], alone[1:])  # the other rows' column 5 left the int8 product
    torch.testing.assert_close(batched[1:], alone[1:], rtol=0, atol=0.05)  # ... which changes them only slightly
