"""``--device`` / ``--device-map`` / ``--compile`` on every command that loads a model, what ``load_target`` /
``load_drafter`` / ``load_pair`` do with them (the quantized path no longer forces the CPU when a device is given),
and the timings that wait for the device (``synchronize``) before reading the clock."""

from __future__ import annotations

import argparse
import types

import pytest
import torch
import transformers
from helpers import tiny_drafter, tiny_target, word_level_tokenizer

import hf_retrace.loading as loading
from hf_retrace.cli import build_parser, main
from hf_retrace.generation import placement

# every command that loads a model, with its required arguments
COMMANDS = {
    "generate": ["generate", "hi"],
    "bench": ["bench"],
    "demo": ["demo"],
    "tune": ["tune"],
    "data generate": ["data", "generate", "--target", "t", "--prompts", "p.jsonl", "--out", "o"],
    "data features": ["data", "features", "--target", "t", "--data", "d", "--out", "o"],
    "data topk": ["data", "topk", "--target", "t", "--data", "d", "--out", "o"],
}
COMPILING = ("generate", "bench")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny float32 target with its tokenizer, and its drafter, on disk."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target("llama", vocab_size=96, dtype=torch.float32, logit_scale=4.0)
    target.save_pretrained(root / "target")
    word_level_tokenizer(96).save_pretrained(root / "target")
    tiny_drafter(target, block_size=6, dtype=torch.float32, draft_vocab_size=50).save_pretrained(root / "drafter")
    return root


@pytest.fixture
def two_gpus(monkeypatch):
    """This machine as one with two CUDA devices, as far as ``--device`` can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


# --- the flags --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_that_loads_a_model_takes_a_device_or_a_device_map(command, two_gpus):
    parse = build_parser().parse_args
    args = parse([*COMMANDS[command], "--device", "cuda:1"])
    assert (args.device, args.device_map) == ("cuda:1", None)
    assert parse([*COMMANDS[command], "--device-map", "auto"]).device_map == "auto"
    mapping = '{"model.embed_tokens": 0, "model.layers": 0, "model.norm": 1, "lm_head": 1}'
    assert parse([*COMMANDS[command], "--device-map", mapping]).device_map["lm_head"] == 1
    assert parse(COMMANDS[command]).device is None  # default: the CPU, as before
    assert getattr(parse(COMMANDS[command]), "compile", None) is (False if command in COMPILING else None)
    if command in COMPILING:
        assert parse([*COMMANDS[command], "--compile"]).compile is True


@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "this machine has no cuda device"),
    (["--device", "gpu0"], "'gpu0' is not a device name"),
    (["--device-map", "everywhere"], "use one of auto, balanced, balanced_low_0, sequential, or a JSON object"),
    (["--device", "cpu", "--device-map", "auto"], "not allowed with argument --device"),
])
def test_a_device_this_machine_lacks_or_a_bad_map_fails_at_parse_time(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*COMMANDS["generate"], *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_device_index_beyond_the_machine_is_refused(two_gpus):
    with pytest.raises(argparse.ArgumentTypeError, match="has 2 cuda device"):
        loading.device_arg("cuda:2")
    assert loading.device_arg("cuda") == "cuda"


# --- loading ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def from_pretrained_kwargs(monkeypatch):
    """The keyword arguments ``load_target`` gives ``from_pretrained`` (no model is loaded)."""
    seen = []

    class Model:
        def eval(self):
            return self

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kwargs: seen.append(kwargs) or Model())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)

    def load(**kwargs) -> dict:
        loading.load_target("some/target", "fp32", **kwargs)
        return seen.pop()

    return load


def test_the_quantized_path_loads_where_asked_and_on_the_cpu_only_by_default(from_pretrained_kwargs):
    assert from_pretrained_kwargs(quantization="8bit")["device_map"] == "cpu"
    assert from_pretrained_kwargs(quantization="8bit", device="cuda:0")["device_map"] == {"": "cuda:0"}
    assert from_pretrained_kwargs(quantization="4bit", device_map="auto")["device_map"] == "auto"


def test_a_device_loads_the_whole_target_there_and_the_cpu_stays_the_default(from_pretrained_kwargs):
    pytest.importorskip("accelerate")
    assert from_pretrained_kwargs(device="cuda:1")["device_map"] == {"": "cuda:1"}
    assert "device_map" not in from_pretrained_kwargs() and "device_map" not in from_pretrained_kwargs(device="cpu")
    assert from_pretrained_kwargs(device_map={"": 0})["device_map"] == {"": 0}
    with pytest.raises(ValueError, match="either a device or a device_map"):
        from_pretrained_kwargs(device="cuda:0", device_map="auto")


def test_load_pair_puts_the_drafter_on_the_target_s_input_embeddings_device(pair, monkeypatch):
    target, _, drafter = loading.load_pair(str(pair / "target"), str(pair / "drafter"), "fp32", device="cpu")
    assert placement.drafter_devices(drafter) == {target.get_input_embeddings().weight.device}
    monkeypatch.setattr(placement, "embedding_device", lambda model: torch.device("meta"))  # the target on "a GPU"
    _, _, drafter = loading.load_pair(str(pair / "target"), str(pair / "drafter"), "fp32")
    assert placement.drafter_devices(drafter) == {torch.device("meta")}


def test_generate_runs_with_a_device_and_a_compiled_drafter(pair, monkeypatch, capsys):
    compiled = []
    compile_drafter = loading.compile_drafter

    def compile_eagerly(drafter, **options):  # dynamo traces the forward; no C++ compiler needed (tests/test_compile)
        compiled.append(drafter)
        return compile_drafter(drafter, backend="eager", **options)

    monkeypatch.setattr(loading, "compile_drafter", compile_eagerly)
    torch._dynamo.reset()
    try:
        assert main(["generate", "the a of to and is in it", "--target", str(pair / "target"), "--drafter",
                     str(pair / "drafter"), "--dtype", "fp32", "--max-new-tokens", "12", "--device", "cpu",
                     "--compile"]) == 0
    finally:
        torch._dynamo.reset()
    assert len(compiled) == 1
    assert "outputs: identical to plain generate" in capsys.readouterr().out


def test_bench_loads_the_target_where_asked_and_every_drafter_beside_its_embeddings(monkeypatch):
    from hf_retrace.bench.commands import spec_from_args
    from hf_retrace.bench.runner import load_models

    args = build_parser().parse_args(["bench", "--device-map", "auto", "--compile", "--drafter", "d1"])
    spec = spec_from_args(args)
    assert (spec.device, spec.device_map, spec.compile) == (None, "auto", True)
    calls = []
    target = tiny_target(dtype=torch.float32)
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: calls.append(("target", a, k)) or (target, None))
    monkeypatch.setattr(loading, "load_drafter", lambda *a, **k: calls.append(("drafter", a, k)))
    load_models(types.SimpleNamespace(spec=spec, target_path="t", drafter_paths={"dflash": "d1", "retrace": "d1"}))
    assert calls == [("target", ("t", "bf16", None), {"device": None, "device_map": "auto"}),
                     ("drafter", ("d1", "bf16"), {"device": torch.device("cpu"), "compile": True})]


# --- timings wait for the device --------------------------------------------------------------------------------------


@pytest.fixture
def synchronized(monkeypatch):
    """The devices ``synchronize`` was called with, by the module given."""
    calls = []

    def patch(module) -> list:
        monkeypatch.setattr(module, "synchronize", lambda device: calls.append(torch.device(device)))
        return calls

    return patch


def test_the_bench_prefill_timing_waits_for_the_device_before_and_after(synchronized):
    import hf_retrace.bench.loop as loop

    calls = synchronized(loop)
    bench = object.__new__(loop.Bench)
    bench.target, bench._prefill_cache = tiny_target(dtype=torch.float32), {}
    assert bench.prefill_seconds(torch.tensor([[1, 2, 3]])) > 0
    assert calls == [torch.device("cpu")] * 2


def test_the_verify_cost_timing_waits_for_the_device_around_every_forward(synchronized):
    import hf_retrace.tuning.costs as costs

    calls = synchronized(costs)
    target, timed_forwards = tiny_target(dtype=torch.float32), []
    forward = target.forward
    target.forward = lambda *args, **kwargs: (timed_forwards.append(calls.copy()), forward(*args, **kwargs))[1]
    curve = costs.measure_verify_costs(target, 2, context_length=8, repeats=1)
    assert len(curve) == 3 and curve[0] == 1
    timed = timed_forwards[-(len(calls) // 2):]  # the probes' forwards (the context's prefill is not timed)
    assert len(calls) == 2 * len(timed) and len(timed) >= 1 + 2 * 2  # a warm-up, then per k = 1, 2 a step and a verify
    assert [len(before) for before in timed] == list(range(1, len(calls), 2))  # each one between its two syncs


# --- --dtype auto (the batched data commands) -------------------------------------------------------------------------


@pytest.mark.parametrize("flags, device, device_map", [([], "cpu", None), (["--device", "cuda:1"], "cuda:1", None),
                                                       (["--device-map", "auto"], None, "auto")])
@pytest.mark.parametrize("bf16_units", [True, False])
def test_dtype_auto_is_bf16_on_accelerators_and_bf16_cpus_and_fp32_elsewhere(flags, device, device_map, bf16_units,
                                                                              two_gpus, monkeypatch):
    from hf_retrace import machine

    monkeypatch.setattr(machine, "has_bf16_units", lambda: bf16_units)
    for command in ("data generate", "data features", "data topk"):
        args = build_parser().parse_args([*COMMANDS[command], *flags])
        assert args.dtype == "auto"  # the default
        expected = "bf16" if bf16_units or device_map or device != "cpu" else "fp32"
        assert loading.resolve_dtype(args.dtype, args.device, args.device_map) == expected
        assert build_parser().parse_args([*COMMANDS[command], "--dtype", "float32"]).dtype == "fp32"  # as given
    assert loading.resolve_dtype("bfloat16") == "bf16"


def test_bf16_units_are_read_from_the_cpu_flags(monkeypatch):
    from hf_retrace import machine

    for flags, expected in [(["avx2", "fma"], False), (["avx2", "avx512f", "avx512_bf16"], True),
                            (["amx_bf16", "amx_tile"], True), (["asimd", "bf16"], True), ([], False)]:
        monkeypatch.setattr(machine, "cpu_info", lambda flags=flags: {"model": "x", "flags": flags, "machine": "m"})
        assert machine.has_bf16_units() is expected


def test_auto_is_refused_where_a_command_does_not_offer_it(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*COMMANDS["generate"], "--dtype", "auto"])
    assert "invalid choice: 'auto'" in capsys.readouterr().err


def test_data_generate_with_dtype_auto_loads_the_resolved_dtype(pair, tmp_path, monkeypatch, capsys):
    from hf_retrace import machine

    monkeypatch.setattr(machine, "has_bf16_units", lambda: False)
    loaded = []
    real = loading.load_target

    def recording(target, dtype="bf16", **kwargs):
        loaded.append(dtype)
        return real(target, dtype, **kwargs)

    monkeypatch.setattr("hf_retrace.training.cli.commands.load_target", recording)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "the a of"}\n')
    assert main(["data", "generate", "--target", str(pair / "target"), "--prompts", str(prompts), "--out",
                 str(tmp_path / "out"), "--max-new-tokens", "3"]) == 0
    assert loaded == ["fp32"] and "--dtype auto: fp32" in capsys.readouterr().err
