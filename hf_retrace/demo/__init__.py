"""``hf-retrace demo``: a Gradio page showing ReTrace drafting, being rejected and recovering, next to plain decoding.

Building the parser needs nothing more than ``import hf_retrace`` did (transformers and torch): gradio and the page
are imported, and the models loaded, when the command runs.
The page lives in :mod:`hf_retrace.demo.app` (``build_app``, ``launch``), the engine in :mod:`hf_retrace.demo.engine`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path

from ..loading import MAX_NEW_TOKENS, SHORT_DTYPES, add_device_arguments, dtype_arg

__all__ = ["register", "cmd_demo"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to the ``hf-retrace`` parser."""
    p = subparsers.add_parser(
        "demo",
        help="a Gradio page: plain decoding next to DFlash / ReTrace, streamed round by round",
        description="Serve a Gradio page that answers a prompt with plain decoding and with the drafter side by side, "
        "colouring each round's accepted drafts, the target's own token and (ReTrace) the fused rounds.",
    )
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="Hub id or folder (default: the drafter shipped for the target)")
    p.add_argument("--host", default=None,
                   help="address to listen on (0.0.0.0: every interface; default: $GRADIO_SERVER_NAME, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="port to listen on (default: $GRADIO_SERVER_PORT, else the first free one from 7860, as "
                   "gradio does)")
    p.add_argument("--share", action="store_true", default=False, help="also open a public *.gradio.live link")
    p.add_argument("--allow-custom-drafters", action="store_true", default=False,
                   help="let the page load drafter folders from this machine's disk even when others can reach it "
                   "(--host beyond localhost, or --share); only on a network you trust")
    p.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="fp32",
                   help="weights dtype (fp32 default: greedy output is then bit-identical to plain decoding)")
    p.add_argument("--concurrency", type=int, default=2, help="requests generating at the same time (queue beyond)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="the largest answer length a request may ask for")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generate calls at start")
    add_device_arguments(p)
    p.set_defaults(func=cmd_demo)
    return p


def _fail(msg: str) -> int:
    print(f"hf-retrace demo: {msg}", file=sys.stderr)
    return 2


def _check_drafter_arg(drafter: str | None) -> str | None:
    """A message when ``--drafter`` (or the default drafter) cannot be a drafter, before any model is loaded."""
    if drafter in (None, "default"):
        from ..defaults import default_drafter_path

        try:
            default_drafter_path()
        except FileNotFoundError as exc:
            return f"{exc}. For now pass --drafter PATH (a drafter folder written by `hf-retrace train`)."
        return None
    path = Path(drafter).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"--drafter {drafter!r} is a file; pass a drafter folder (config.json + model.safetensors)."
        if not (path / "config.json").is_file():
            return f"--drafter {drafter!r} is not a drafter folder: it has no config.json."
        return None
    return _not_a_hub_id("--drafter", drafter)


def _check_gradio_env() -> str | None:
    """A message when ``GRADIO_SERVER_PORT`` is set but is no port (gradio itself would fail on import with a bare
    ``ValueError``). ``--host`` / ``--port`` left unset leave both variables to gradio, which reads them as usual."""
    value = os.environ.get("GRADIO_SERVER_PORT")
    if value is None:
        return None
    if not value.strip().isdigit() or not 1 <= int(value) <= 65535:
        return f"GRADIO_SERVER_PORT={value!r} is not a port in 1..65535; unset it or pass --port."
    return None


def _not_a_hub_id(flag: str, value: str) -> str | None:
    """A message when ``value`` is neither an existing folder nor shaped like a Hub id (``owner/name``)."""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", value) and not value.startswith((".", "/")):
        return None
    return f"{flag} {value!r} is not a folder here and not a Hub id (owner/name)."


def cmd_demo(args: argparse.Namespace) -> int:
    if args.port is not None and not 1 <= args.port <= 65535:
        return _fail(f"--port must be in 1..65535, got {args.port}.")
    message = _check_gradio_env()
    if message:
        return _fail(message)
    if args.concurrency < 1:
        return _fail(f"--concurrency must be at least 1, got {args.concurrency}.")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        return _fail(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {args.max_new_tokens}.")
    message = _check_drafter_arg(args.drafter)
    if message is None and args.target not in (None, "default") and not Path(args.target).expanduser().exists():
        message = _not_a_hub_id("--target", args.target)
    if message:
        return _fail(message)
    if importlib.util.find_spec("gradio") is None:
        return _fail('gradio is not installed; run `pip install "hf-retrace[demo]"` (gradio>=5,<7).')

    from .app import build_app, launch
    from .engine import DemoEngine
    from .limits import DemoError, Limits

    try:
        engine = DemoEngine.from_pretrained(
            args.target,
            args.drafter,
            dtype=args.dtype,
            device=args.device,
            device_map=args.device_map,
            limits=Limits(max_new_tokens=args.max_new_tokens),
            warmup=not args.no_warmup,
        )
    except DemoError as exc:
        return _fail(str(exc))
    app = build_app(engine, concurrency=args.concurrency)
    # the page's "drafter folder" box reads server paths: launch() keeps it to a private server unless allowed
    launch(app, host=args.host, port=args.port, share=args.share,
           allow_custom_drafters=True if args.allow_custom_drafters else None)
    return 0
