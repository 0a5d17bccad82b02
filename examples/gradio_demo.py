"""The hf-retrace demo page: plain decoding next to DFlash / ReTrace, streamed round by round.

    python examples/gradio_demo.py                                  # embedded SmolLM2 + its shipped drafter
    python examples/gradio_demo.py --drafter path/to/drafter        # until the default drafter is built
    python examples/gradio_demo.py --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --dtype bf16

Same as ``hf-retrace demo`` (same flags); needs ``pip install "hf-retrace[demo]"``. Open http://127.0.0.1:7860.
"""

from __future__ import annotations

import argparse
import sys

from hf_retrace.demo import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradio_demo.py", description=__doc__.split("\n")[1])
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    # cmd_demo: DemoEngine.from_pretrained(target, drafter) -> build_app(engine) -> launch(app, host, port, share)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
