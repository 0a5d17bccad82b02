"""``hf-retrace``: generate | data | train | bench | demo."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def load_target(target: str | None, dtype: str = "bf16", quantization: str | None = None):
    """(target model, tokenizer) from a Hub id / folder, or the embedded default when ``None``/"default"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import defaults

    torch_dtype = getattr(torch, DTYPES[dtype])
    if target in (None, "default"):
        print(f"[hf-retrace] target: {defaults.describe_default_target_source()}", file=sys.stderr)
        target = str(defaults.ensure_default_target())
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if quantization:
        from transformers import BitsAndBytesConfig

        bits = {"8bit": dict(load_in_8bit=True), "4bit": dict(load_in_4bit=True, bnb_4bit_compute_dtype=torch_dtype)}
        kwargs |= {"quantization_config": BitsAndBytesConfig(**bits[quantization]), "device_map": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(target, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(target)


def load_drafter(drafter: str | None, dtype: str = "bf16"):
    """A drafter from a Hub id / folder, or the one shipped for the embedded default when ``None``/"default"."""
    import torch

    from . import defaults
    from .modeling import ReTraceDrafter

    path = defaults.default_drafter_path() if drafter in (None, "default") else drafter
    return ReTraceDrafter.from_pretrained(path, dtype=getattr(torch, DTYPES[dtype])).eval()


def load_pair(target: str | None, drafter: str | None, dtype: str = "bf16", quantization: str | None = None):
    """(target, tokenizer, drafter); ``None`` or "default" picks the embedded default for either."""
    if drafter in (None, "default"):
        from . import defaults

        defaults.default_drafter_path()  # fail before the target is loaded when no drafter ships
    model, tokenizer = load_target(target, dtype, quantization)
    return model, tokenizer, load_drafter(drafter, dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .side_by_side import compare

    torch.manual_seed(args.seed)
    target, tokenizer, drafter = load_pair(args.target, args.drafter, args.dtype)
    if args.no_retrace:
        drafter.config.use_retrace = False
    result = compare(target, tokenizer, drafter, args.prompt, args.max_new_tokens, args.temperature, args.seed)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    stats = result.drafted.stats or {}
    print(result.drafted.text)
    print()
    print(f"plain generate          : {result.plain.tokens_per_second:6.1f} tokens/s ({len(result.plain.token_ids)} tokens)")
    print(f"with the ReTrace drafter: {result.drafted.tokens_per_second:6.1f} tokens/s "
          f"(tau = {stats.get('mean_acceptance_length', 0):.2f} tokens per target forward)")
    print(f"speed-up {result.speedup:.2f}x; outputs identical: {result.identical}")
    if not result.identical and args.temperature == 0 and args.dtype != "fp32":
        print("(bf16: a multi-token verify can round differently from one-token decoding at near-ties; "
              "use --dtype fp32 for a bit-exact comparison)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace", description="Lossless speculative decoding with ReTrace.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer a prompt with and without the drafter; print tau and both speeds")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", default=None, help="Hub id or folder (default: the drafter shipped for it)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    gen.add_argument("--no-retrace", action="store_true", help="use the DFlash backbone alone")
    gen.add_argument("--json", action="store_true", help="print the answer, tau and both speeds as JSON")
    gen.set_defaults(func=cmd_generate)

    from .bench.commands import register as register_bench
    from .training.commands import register as register_training

    register_training(sub)
    register_bench(sub)
    try:
        from .demo import register as register_demo
    except ImportError:  # pragma: no cover - the demo module is optional until built
        register_demo = None
    if register_demo is not None:
        register_demo(sub)
    return parser


def validate_generate_args(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        raise SystemExit("hf-retrace generate: the prompt is empty; pass some text to answer.")
    if not 1 <= args.max_new_tokens <= 8192:
        raise SystemExit(f"hf-retrace generate: --max-new-tokens must be in 1..8192, got {args.max_new_tokens}.")
    if args.temperature < 0:
        raise SystemExit(f"hf-retrace generate: --temperature must be >= 0, got {args.temperature}.")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        validate_generate_args(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
