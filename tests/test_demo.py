"""The Gradio demo (``hf-retrace demo``), driven through ``gradio_client`` against a server on localhost.

Everything runs on tiny models built here: a character-level tokenizer with a chat template, a tiny random Llama
target and a tiny random drafter (ReTrace on, random fusion weights, so fused rounds really change the drafts), all
saved to a temporary folder and loaded back through the demo's own loading path (``DemoEngine.from_pretrained``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import ProposalPolicy, tiny_drafter, tiny_target

from hf_retrace.demo.app import (
    DemoEngine,
    DemoError,
    RoundInfo,
    RoundStreamer,
    SideState,
    render_tokens,
)

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
pytestmark = [  # gradio's own use of pandas 3, not ours
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_NEW = 32


# ------------------------------------------------------------------------------------------------ tiny models on disk


def build_tokenizer():
    """A character-level tokenizer (printable ASCII + newline, three special tokens) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special + [chr(c) for c in range(32, 127)] + ["\n"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_pair(root: Path) -> dict[str, Path]:
    """Save a tiny target (+ tokenizer), a tiny ReTrace drafter and a folder that is not a drafter under ``root``."""
    tokenizer = build_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer), dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, retrace="random", dtype=torch.float32)
    paths = {"target": root / "target", "drafter": root / "drafter", "not_a_drafter": root / "notes"}
    target.save_pretrained(paths["target"])
    tokenizer.save_pretrained(paths["target"])
    drafter.save_pretrained(paths["drafter"])
    paths["not_a_drafter"].mkdir(parents=True)
    (paths["not_a_drafter"] / "README.md").write_text("just notes\n")
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: DemoEngine, concurrency: int = 2):
    """Build the page for ``engine`` and serve it in this process; returns ``(blocks, url)``."""
    from hf_retrace.demo.app import build_app, launch

    blocks = build_app(engine, concurrency=concurrency)
    port = free_port()
    launch(blocks, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    return blocks, f"http://127.0.0.1:{port}/"


class CountingEngine(DemoEngine):
    """Test-only: records how many requests were streaming at the same time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._active, self.max_active, self._count_lock = 0, 0, threading.Lock()

    def stream(self, *args, **kwargs):
        with self._count_lock:
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        try:
            yield from super().stream(*args, **kwargs)
        finally:
            with self._count_lock:
                self._active -= 1


def load_engine(paths: dict[str, Path], **kwargs) -> CountingEngine:
    """The tiny pair loaded through the demo's own path (``DemoEngine.from_pretrained``); skips without gradio."""
    pytest.importorskip("gradio", reason="the demo extra is not installed: pip install 'hf-retrace[demo]'")
    return CountingEngine.from_pretrained(str(paths["target"]), str(paths["drafter"]), dtype="fp32", **kwargs)


# ---------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("demo_models"))


@pytest.fixture(scope="module")
def engine(paths):
    return load_engine(paths)


@pytest.fixture(scope="module")
def server(engine):
    blocks, url = start_server(engine, concurrency=2)
    yield url
    blocks.close()


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server, verbose=False, download_files=False, analytics_enabled=False)


def run(client, prompt="Say hello.", method="retrace", temperature=0.0, max_new_tokens=MAX_NEW, seed=0, drafter=""):
    """The page's one endpoint; returns the JSON summary (the last of the six outputs)."""
    outputs = client.predict(prompt, method, temperature, max_new_tokens, seed, drafter, api_name="/run")
    assert len(outputs) == 6
    return outputs


def reference_ids(engine, prompt: str, max_new_tokens: int = MAX_NEW) -> list[int]:
    """Plain greedy ``generate`` on the same model, outside the demo."""
    from hf_retrace.side_by_side import chat_input_ids

    ids = chat_input_ids(engine.tokenizer, prompt)
    with torch.inference_mode():
        out = engine.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, temperature=None, top_p=None, top_k=None)
    return out[0, ids.shape[1]:].tolist()


# ------------------------------------------------------------------------------------------- through the real server


def test_retrace_side_by_side_matches_plain_generate(client, engine):
    plain_html, drafted_html, metrics_html, plot, summary, status = run(client, "Say hello.", "retrace")
    expected = reference_ids(engine, "Say hello.")
    assert summary["plain"]["token_ids"] == expected
    assert summary["drafted"]["token_ids"] == expected
    assert summary["identical"] is True
    assert summary["plain"]["text"] == summary["drafted"]["text"] == engine.tokenizer.decode(expected,
                                                                                             skip_special_tokens=True)
    drafted = summary["drafted"]
    # the rounds add up: each drafting round commits accepted + 1 tokens; the prefill's token (and the last one, with
    # no room left to draft) stand alone
    assert 1 <= drafted["target_only_tokens"] <= 2
    assert sum(a + 1 for a, _, _ in drafted["rounds"]) + drafted["target_only_tokens"] == len(expected)
    assert drafted["tau"] == pytest.approx(drafted["stats"]["mean_acceptance_length"])
    assert [list(r) for r in drafted["rounds"]] == drafted["stats"]["round_log"]
    # ReTrace: every round after one with a kept rejected suffix drafts a fused block
    assert drafted["fused_rounds"] == drafted["stats"]["rounds_with_fused_suffix"] > 0
    assert 'class="hfr-round hfr-fused"' in drafted_html and "hfr-cor" in drafted_html and "hfr-tgt" in drafted_html
    assert "hfr-running" not in drafted_html and "hfr-running" not in plain_html
    assert "τ" in metrics_html and "speed-up" in metrics_html and "yes ✓" in metrics_html
    assert "identical to plain decoding" in status
    assert plot is not None  # the per-position acceptance bar plot
    assert summary["plain"]["tokens_per_second"] > 0 and summary["drafted"]["tokens_per_second"] > 0


def test_methods(client, engine):
    *_, dflash, status = run(client, "Count to five.", "dflash")
    assert dflash["drafted"]["method"] == "dflash" and dflash["identical"] is True
    assert dflash["drafted"]["fused_rounds"] == 0  # ReTrace off: no block is ever fused
    *_, retrace, _ = run(client, "Count to five.", "retrace")
    assert retrace["drafted"]["fused_rounds"] > 0 and retrace["identical"] is True
    assert retrace["drafted"]["token_ids"] == dflash["drafted"]["token_ids"] == reference_ids(engine, "Count to five.")
    _, drafted_html, _, plot, plain_only, status = run(client, "Count to five.", "plain")
    assert plain_only["drafted"] is None and plot is None and "Plain decoding only" in drafted_html
    assert plain_only["plain"]["token_ids"] == dflash["plain"]["token_ids"]


def test_sampling_is_repeatable_per_seed(client):
    *_, a, _ = run(client, "Tell a story.", "retrace", temperature=0.9, seed=7)
    *_, b, _ = run(client, "Tell a story.", "retrace", temperature=0.9, seed=7)
    assert a["plain"]["token_ids"] == b["plain"]["token_ids"]
    assert a["drafted"]["token_ids"] == b["drafted"]["token_ids"]
    assert a["identical"] is not None and len(a["drafted"]["token_ids"]) == MAX_NEW


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="   \n "), "prompt is empty"),
        (dict(prompt="x" * 20_000), "characters long"),
        (dict(max_new_tokens=10**9), "max new tokens must be a whole number from 1 to"),
        (dict(max_new_tokens=0), "max new tokens"),
        (dict(max_new_tokens=2.5), "max new tokens"),
        (dict(temperature=-1), "temperature must be between"),
        (dict(temperature=1e9), "temperature must be between"),
        (dict(method="beam"), "unknown method"),
        (dict(seed=-3), "seed"),
        (dict(drafter="/definitely/not/here"), "not a folder"),
    ],
)
def test_bad_input_gets_a_message(client, kwargs, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=message):
        run(client, **kwargs)


def test_not_a_drafter_folder_gets_a_message_and_the_server_keeps_serving(client, paths, engine):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="not a drafter folder: it has no config.json"):
        run(client, drafter=str(paths["not_a_drafter"]))
    with pytest.raises(AppError, match="not a drafter for this target"):  # a model folder, but not a drafter
        run(client, drafter=str(paths["target"]))
    # the page keeps serving, and a real drafter folder given in the page works
    *_, summary, status = run(client, "Hi", drafter=str(paths["drafter"]))
    assert summary["identical"] is True and summary["plain"]["token_ids"] == reference_ids(engine, "Hi")


def test_two_concurrent_requests_get_what_they_get_alone(client, engine):
    requests = [
        dict(prompt="What is the capital of France?", method="retrace", max_new_tokens=48),
        dict(prompt="Name a colour.", method="dflash", temperature=0.8, seed=3, max_new_tokens=40),
    ]
    alone = [run(client, **r)[4] for r in requests]
    engine.max_active = 0
    jobs = [client.submit(r["prompt"], r["method"], r.get("temperature", 0.0), r["max_new_tokens"], r.get("seed", 0),
                          "", api_name="/run") for r in requests]
    together = [job.result(timeout=120)[4] for job in jobs]
    assert engine.max_active == 2, "the two requests did not run at the same time"
    for a, t in zip(alone, together):
        for side in ("plain", "drafted"):
            assert t[side]["token_ids"] == a[side]["token_ids"]
            assert t[side].get("rounds") == a[side].get("rounds")
    assert together[0]["identical"] is True


def test_streams_partial_updates(client):
    """The endpoint is a generator: the client sees intermediate outputs before the final one."""
    job = client.submit("Stream please.", "retrace", 0.0, 96, 0, "", api_name="/run")
    job.result(timeout=120)
    outputs = job.outputs()
    assert len(outputs) >= 3  # the first snapshot, updates while generating, the final one
    assert outputs[0][5].startswith("Plain decoding") and outputs[-1][5].startswith("Done")


# ---------------------------------------------------------------------------------------------- pieces, no server


def test_streamer_reconciles_rounds_with_the_live_stats(engine, use_policy):
    """With a drafter that accepts part of each block, every colour shows up and the spans add up to the rounds."""
    prompt = "Partial acceptance."
    from hf_retrace.side_by_side import chat_input_ids

    continuation = torch.tensor([reference_ids(engine, prompt, MAX_NEW + 8)])
    ref = torch.cat([chat_input_ids(engine.tokenizer, prompt), continuation], dim=1)
    use_policy(ProposalPolicy(ref, "partial", vocab_size=len(engine.tokenizer), seed=1))
    for snap in engine.stream(prompt, "dflash", 0.0, MAX_NEW, 0):
        pass
    side = snap.drafted
    assert snap.identical and side.token_ids == ref[0, -(MAX_NEW + 8):-8].tolist()
    stats = side.stats
    assert [[r.accepted, r.drafted, r.fused] for r in side.drafted_rounds] == stats["round_log"]
    assert sum(r.accepted for r in side.rounds) > 0
    html = render_tokens(side)
    pieces = sum(1 for r, p in zip(side.rounds, side.pieces) for i, piece in enumerate(p) if piece and i < r.accepted)
    assert html.count('class="hfr-acc"') == pieces
    assert "hfr-bon" in html and "hfr-cor" in html  # full-block rounds and rejected ones both happen
    assert side.tau == pytest.approx(stats["mean_acceptance_length"])


def test_round_streamer_without_drafter_posts_one_token_per_put():
    got = []
    streamer = RoundStreamer(got.append)
    streamer.put(torch.tensor([[5, 6, 7]]))  # the prompt echo
    streamer.put(torch.tensor([8]))
    streamer.put(torch.tensor([9]))
    streamer.end()
    assert [r.tokens for r in got] == [(8,), (9,)] and all(r.drafted == 0 for r in got)


def test_render_escapes_text_and_marks_rejections():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join({1: "<b>", 2: "&", 3: "x"}[i] for i in ids)

    side = SideState("retrace", "ReTrace", Tok())
    side.add_round(RoundInfo((1,)))
    side.add_round(RoundInfo((2, 3), accepted=1, drafted=4, fused=True))
    html = render_tokens(side)
    assert "<b>" not in html.replace('<span class="', "") and "&lt;b&gt;" in html and "&amp;" in html
    assert 'data-n="3"' in html and "hfr-fused" in html and "hfr-running" in html


def test_validate_normalises(engine):
    assert engine.validate(" hi ", "plain", "0.5", 12.0, 3.0) == (" hi ", "plain", 0.5, 12, 3)
    with pytest.raises(DemoError, match="temperature"):
        engine.validate("hi", "plain", float("nan"), 12, 0)


def test_demo_module_imports_cheaply_and_cli_rejects_bad_drafter(paths):
    from hf_retrace.cli import build_parser

    args = build_parser().parse_args(["demo", "--target", str(paths["target"])])
    # host and port unset: gradio's own defaults and GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (tests/test_demo_port.py)
    assert (args.host, args.port, args.share, args.dtype, args.drafter) == (None, None, False, "fp32", None)
    code = (
        "import sys, hf_retrace.demo\n"
        "print('gradio' in sys.modules, 'hf_retrace.demo.app' in sys.modules)\n"
        "from hf_retrace.cli import main\n"
        "print(main(['demo', '--drafter', sys.argv[1]]), 'gradio' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(paths["not_a_drafter"])], capture_output=True, text=True)
    # importing the subcommand loads no gradio; a wrong --drafter is refused with one line, before any model loads
    assert proc.stdout.split() == ["False", "False", "2", "False"], proc.stdout + proc.stderr
    assert "is not a drafter folder: it has no config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_concurrent_streams_share_nothing(engine):
    """The engine alone, four threads at once: each gets exactly its solo answer."""
    prompts = ["One.", "Two two.", "Three three three.", "Four."]
    methods = ["retrace", "dflash", "retrace", "dflash"]

    def answer(i):
        for snap in engine.stream(prompts[i], methods[i], 0.0, 24, 0):
            pass
        return snap.summary()

    alone = [answer(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(answer, range(4)))
    for a, t in zip(alone, together):
        assert t["drafted"]["token_ids"] == a["drafted"]["token_ids"] == a["plain"]["token_ids"]
        assert t["drafted"]["rounds"] == a["drafted"]["rounds"]


def test_methods_are_views_of_one_drafter(engine):
    """DFlash and ReTrace share the loaded weights; each view has its own fixed round policy (nothing flips per
    request, nothing shared is changed)."""
    views = engine.drafters
    assert views.backbone.fc.weight is views.retrace.fc.weight
    assert views.backbone.retrace is views.retrace.retrace
    assert views.backbone.policy_changes == {"retrace": False} and views.retrace.policy_changes == {"retrace": True}
    assert views.backbone.config is views.retrace.config  # one config: it holds the shape, not a call's choices
