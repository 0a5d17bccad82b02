"""The Gradio page: plain decoding next to DFlash / ReTrace, streamed round by round.

:func:`build_app` lays out the page (``gr.Blocks`` + queue) for a :class:`~hf_retrace.demo.engine.DemoEngine`;
:func:`launch` serves it. The parts live beside this file, bottom up: ``limits`` (what a request may ask), ``rounds``
(the streamer), ``worker`` (one ``generate`` in its own thread), ``snapshot`` (what the page shows, as data),
``drafters`` and ``engine`` (the shared models, one request at a time), ``render`` (the HTML). Their public names are
importable from here too.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no phoning home from an offline demo

from .engine import DemoEngine
from .limits import METHODS, DemoError, Limits
from .render import CSS, LEGEND_HTML, acceptance_frame, render_metrics, render_tokens
from .rounds import RoundInfo, RoundStreamer
from .snapshot import SideState, Snapshot

__all__ = [
    "METHODS",
    "DemoEngine",
    "DemoError",
    "Limits",
    "RoundInfo",
    "RoundStreamer",
    "SideState",
    "Snapshot",
    "build_app",
    "is_private",
    "launch",
    "render_tokens",
]

logger = logging.getLogger("hf_retrace.demo")

EXAMPLE_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five fruits and the colour of each.",
]
_PAGE = "_hf_retrace_page"  # the attribute of a built page that tells launch() its engine
_NO_FOLDERS = "off: this server is shared or listens beyond localhost"


class _Handler:
    """The page's one event: validate, stream the engine's snapshots as component values, report errors in the page."""

    def __init__(self, engine: DemoEngine):
        self.engine = engine

    def __call__(self, prompt, method, temperature, max_new_tokens, seed, drafter_path):
        import gradio as gr

        stream = None
        try:
            stream = self.engine.stream(prompt, method, temperature, max_new_tokens, seed, drafter_path or None)
            for n, snap in enumerate(stream):
                if n == 0:
                    for note in snap.notes:
                        gr.Info(note)
                yield self._values(snap)
        except DemoError as exc:
            yield self._status_only(f"⚠️ {exc}")
            raise gr.Error(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - one failed request must not look like a crash
            logger.exception("request failed")
            yield self._status_only(f"⚠️ the request failed: {type(exc).__name__}: {exc}")
            raise gr.Error(f"the request failed: {type(exc).__name__}: {exc}") from None
        finally:
            if stream is not None:
                stream.close()

    @staticmethod
    def _values(snap: Snapshot) -> tuple:
        if snap.drafted is None:
            drafted = render_tokens(None, "Plain decoding only: choose DFlash or ReTrace to compare.")
        elif not snap.drafted.rounds and not snap.drafted.done:
            drafted = render_tokens(None, "starts when plain decoding has finished…")
        else:
            drafted = render_tokens(snap.drafted)
        return (
            render_tokens(snap.plain),
            drafted,
            render_metrics(snap),
            _plot_update(acceptance_frame(snap)),
            snap.summary() if snap.done else None,
            snap.status,
        )

    @staticmethod
    def _status_only(message: str) -> tuple:
        import gradio as gr

        return (gr.update(), gr.update(), gr.update(), gr.update(), gr.update(), message)


def _plot_update(frame: Any) -> Any:
    import gradio as gr

    if frame is None:
        return None
    return gr.update(value=frame, sort=list(frame["draft slot"]))  # slot order, not "1, 10, 11, ..., 2"


@dataclass
class _Page:
    """What :func:`launch` needs of a page :func:`build_app` made: the engine, and the drafter-folder box."""

    engine: DemoEngine
    drafter_box: Any

    def allow_custom_drafters(self, allowed: bool) -> None:
        self.engine.allow_custom_drafters = allowed
        self.drafter_box.interactive = allowed
        self.drafter_box.placeholder = "/path/to/drafter" if allowed else _NO_FOLDERS


def _blocks(title: str) -> Any:
    import warnings

    import gradio as gr

    system = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"]
    mono = ["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]
    theme = gr.themes.Default(font=system, font_mono=mono)  # no web fonts: the page also works offline
    with warnings.catch_warnings():  # gradio 6 moved css/theme to launch(); Blocks() still honours them
        warnings.simplefilter("ignore")
        return gr.Blocks(title=title, css=CSS, theme=theme, analytics_enabled=False)


def _intro(engine: DemoEngine, title: str) -> str:
    return (
        f"## {title}\n"
        "Lossless speculative decoding: a DFlash block drafter proposes a block of tokens per round and the target "
        "verifies the block in one forward. With **ReTrace**, the drafts the target rejected are kept and fused "
        "into the next block. Left: plain decoding; right: the chosen method, round by round.\n\n"
        f"<small>target: `{engine.target_source}` · drafter: `{engine.describe_drafter()}` · "
        f"dtype {str(engine.target.dtype).replace('torch.', '')}</small>"
    )


def _request_inputs(engine: DemoEngine) -> list:
    """The request's controls, in the handler's argument order: prompt, method, temperature, max new tokens, seed,
    drafter folder."""
    import gradio as gr

    limits, allowed = engine.limits, engine.allow_custom_drafters
    retrace_ok = engine.drafters.retrace is not None
    choices = [(label, key) for key, label in METHODS.items() if key != "retrace" or retrace_ok]
    with gr.Row():
        with gr.Column(scale=3):
            prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, elem_id="hfr-prompt",
                                placeholder="Ask something…", max_length=limits.max_prompt_chars)
        with gr.Column(scale=2):
            method = gr.Radio(choices, value="retrace" if retrace_ok else "dflash", label="Method",
                              elem_id="hfr-method")
            with gr.Row():
                temperature = gr.Slider(0.0, limits.max_temperature, value=0.0, step=0.05,
                                        label="Temperature (0 = greedy)", elem_id="hfr-temperature")
                max_new_tokens = gr.Slider(1, limits.max_new_tokens, value=min(128, limits.max_new_tokens), step=1,
                                           label="Max new tokens", elem_id="hfr-max-new-tokens")
    with gr.Accordion("More settings", open=False):
        with gr.Row():
            seed = gr.Number(value=0, precision=0, label="Seed (sampling only)", minimum=0, maximum=limits.max_seed)
            drafter_path = gr.Textbox(
                label="Drafter folder on the server (empty: the loaded drafter)", elem_id="hfr-drafter",
                interactive=allowed, placeholder="/path/to/drafter" if allowed else _NO_FOLDERS,
            )
    return [prompt, method, temperature, max_new_tokens, seed, drafter_path]


def _answer_outputs() -> list:
    """The answers and their measurements: plain HTML, drafted HTML, metric cards, acceptance plot, JSON summary."""
    import gradio as gr

    with gr.Row(equal_height=False):
        with gr.Column():
            gr.Markdown("### Plain decoding\n<small>one target forward per token</small>")
            plain_out = gr.HTML(render_tokens(None, "(the answer appears here)"), elem_id="hfr-plain-output")
        with gr.Column():
            gr.Markdown("### Speculative decoding\n<small>one target forward per round</small>")
            gr.HTML(LEGEND_HTML)
            drafted_out = gr.HTML(render_tokens(None, "(the answer appears here)"), elem_id="hfr-drafted-output")
    metrics = gr.HTML(render_metrics(None), elem_id="hfr-metrics-box")
    plot = gr.BarPlot(
        None, x="draft slot", y="acceptance rate", y_lim=[0, 1], height=220, elem_id="hfr-acceptance-plot",
        label="Per-position acceptance (share of rounds whose draft at this slot was accepted)",
        x_title="draft slot", y_title="acceptance rate",
    )
    with gr.Accordion("Details (JSON)", open=False):
        summary = gr.JSON(label="Summary of the last run", elem_id="hfr-summary")
    return [plain_out, drafted_out, metrics, plot, summary]


def build_app(engine: DemoEngine, concurrency: int = 2, title: str = "hf-retrace: ReTrace live") -> Any:
    """The Gradio page for ``engine``. ``concurrency``: requests generating at once (more wait in the queue).

    Serve it with :func:`launch`, which decides whether the page may load drafter folders from the server's disk.
    """
    import gradio as gr

    with _blocks(title) as blocks:
        gr.Markdown(_intro(engine, title))
        inputs = _request_inputs(engine)
        run = gr.Button("Generate side by side", variant="primary", elem_id="hfr-run")
        status = gr.Markdown("Type a prompt and press *Generate*.", elem_id="hfr-status")
        outputs = [*_answer_outputs(), status]
        gr.Examples(EXAMPLE_PROMPTS, inputs=inputs[:1], label="Examples")
        handler = _Handler(engine)

        def generate_side_by_side(prompt, method, temperature, max_new_tokens, seed, drafter_path):
            yield from handler(prompt, method, temperature, max_new_tokens, seed, drafter_path)

        gr.on([run.click, inputs[0].submit], generate_side_by_side, inputs, outputs, api_name="run",
              concurrency_limit=concurrency, show_progress="minimal",
              preprocess=False)  # raw values: validate() names the field in its messages
    blocks.queue(max_size=64, default_concurrency_limit=concurrency)
    setattr(blocks, _PAGE, _Page(engine, drafter_box=inputs[-1]))
    return blocks


def is_private(host: str | None, share: bool = False) -> bool:
    """True when only this machine can reach a server on ``host``: no share link, and a loopback address."""
    if share:
        return False
    host = (host or os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1").strip("[]").lower()  # gradio's default
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name may resolve to any interface


def launch(
    app: Any,
    host: str | None = None,
    port: int | None = None,
    share: bool = False,
    *,
    allow_custom_drafters: bool | None = None,
    **kwargs: Any,
):
    """Serve ``app`` (blocks until stopped unless ``prevent_thread_lock=True``).

    ``host`` / ``port`` left ``None`` are gradio's to choose, as in ``gr.Blocks.launch``: ``GRADIO_SERVER_NAME`` (else
    127.0.0.1) and ``GRADIO_SERVER_PORT`` (else the first free port from 7860); a value given wins over them.
    The page's drafter-folder box loads folders from the server's disk, so it is on only for a private server
    (:func:`is_private`: a loopback ``host`` and no ``share`` link). ``allow_custom_drafters=True`` turns it on for
    everyone who reaches the server (a trusted network only); ``False`` turns it off everywhere.
    """
    page = getattr(app, _PAGE, None)
    if page is not None:
        if allow_custom_drafters is None:
            allow_custom_drafters = page.engine.allow_custom_drafters and is_private(host, share)
        elif allow_custom_drafters and not is_private(host, share):
            logger.warning("the page loads drafter folders from this server's disk for anyone who reaches %s",
                           host or os.environ.get("GRADIO_SERVER_NAME"))
        page.allow_custom_drafters(allow_custom_drafters)
    kwargs.setdefault("show_error", True)
    kwargs.setdefault("ssr_mode", False)  # SSR needs Node.js and adds nothing here
    return app.launch(server_name=host, server_port=port, share=share, **kwargs)
