"""The demo server under stress: a client that goes away mid-answer, a generate that raises, a page others can reach.

Runs the real Gradio server in this process on the tiny models of ``test_demo`` (loaded through the demo's own path),
with a probe on the target's forward that counts target forwards (one per plain token, one per drafting round), can
slow them down (so a request is still running when the test acts) and can make one of them raise.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_demo import MAX_NEW, free_port, load_engine, paths, run, start_server  # noqa: F401 - paths: a fixture

pytestmark = [  # gradio's own use of pandas 3, not ours
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

LONG = 200  # new tokens of a request that must still be running when the test acts


class ForwardProbe:
    """A forward hook: counts calls, sleeps ``delay`` seconds in each, raises at call number ``fail_at``."""

    def __init__(self):
        self.calls, self.delay, self.fail_at = 0, 0.0, None

    def __call__(self, module, args, output):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            self.fail_at = None
            raise RuntimeError("injected failure")
        time.sleep(self.delay)


def generate_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hf-retrace-demo")]


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def probed(paths):
    """``(engine, target probe, drafter probe)``: one engine for the module, its forwards watched."""
    engine = load_engine(paths)
    target_probe, drafter_probe = ForwardProbe(), ForwardProbe()
    handles = [engine.target.register_forward_hook(target_probe),
               engine.drafters.backbone.register_forward_hook(drafter_probe)]  # the views share the drafter's hooks
    yield engine, target_probe, drafter_probe
    for handle in handles:
        handle.remove()


@pytest.fixture
def probes(probed):
    engine, target_probe, drafter_probe = probed
    yield probed
    target_probe.delay, target_probe.fail_at, drafter_probe.fail_at = 0.0, None, None
    assert wait_until(lambda: not generate_threads(), timeout=30), "a generate thread outlived its test"


def connect(url: str):
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False, analytics_enabled=False)


# ------------------------------------------------------------------------------------ a client that goes away


def test_cancel_stops_the_generation_within_a_round_and_frees_the_slot(probes):
    engine, target_probe, _ = probes
    target_probe.delay = 0.2  # a round is one target forward: 0.2 s
    blocks, url = start_server(engine, concurrency=1)
    try:
        client = connect(url)
        job = client.submit("Tell a long story.", "retrace", 0.9, LONG, 1, "", api_name="/run")
        start = target_probe.calls
        assert wait_until(lambda: target_probe.calls >= start + 3), "the request never started generating"
        job.cancel()
        at_cancel = target_probe.calls
        assert wait_until(lambda: not generate_threads(), timeout=10), "generate kept running after the cancel"
        assert target_probe.calls - at_cancel <= 2, "generate ran on past the round under way"
        # the only slot (concurrency 1) and the sampling lock are free again: a sampled request runs to the end
        target_probe.delay = 0.0
        *_, summary, status = run(client, "Hi", "dflash", temperature=0.9, max_new_tokens=4)
        assert status.startswith("Done") and summary["drafted"]["new_tokens"] == 4
    finally:
        blocks.close()


def test_a_request_cancelled_while_waiting_for_the_sampler_leaves_at_once(probes):
    """Sampled requests take turns (torch's RNG is process-wide). One that waits for its turn and is cancelled leaves
    the server at once (it does not sit out the turn of the request ahead of it, holding a server thread), and its
    slot serves the next request while the sampled request ahead of it is still generating."""
    engine, target_probe, _ = probes
    target_probe.delay = 0.05
    blocks, url = start_server(engine, concurrency=2)
    try:  # one client each: gradio's cancel ends every run of the endpoint in the cancelling client's session
        running = connect(url).submit("Tell a long story.", "dflash", 0.9, LONG, 1, "", api_name="/run")
        start = target_probe.calls
        assert wait_until(lambda: target_probe.calls >= start + 2), "the first request never started generating"
        waiting = connect(url).submit("Tell another story.", "dflash", 0.9, LONG, 2, "", api_name="/run")
        assert wait_until(lambda: engine._active == 2), "the second request never started"
        time.sleep(0.3)  # it is waiting for the sampler now
        threading.Thread(target=waiting.cancel, daemon=True).start()
        assert wait_until(lambda: engine._active == 1, timeout=5), \
            "the cancelled request stayed in the server, waiting for the sampler, while the request ahead of it ran"
        quick = connect(url).submit("Hi", "plain", 0.0, 3, 0, "", api_name="/run")  # greedy: needs a slot only
        assert quick.result(timeout=120)[5].startswith("Done")
        assert not running.done(), "the cancelled request kept its slot until the request ahead of it had finished"
        assert running.result(timeout=120)[5].startswith("Done")  # the request ahead was left alone
    finally:
        blocks.close()


# ------------------------------------------------------------------------------------ a generate that raises


@pytest.mark.parametrize("where, side", [("target", "Plain decoding"), ("drafter", "ReTrace")])
def test_the_server_keeps_serving_after_generate_raises(probes, where, side):
    from gradio_client.exceptions import AppError

    engine, target_probe, drafter_probe = probes
    probe = target_probe if where == "target" else drafter_probe
    blocks, url = start_server(engine, concurrency=1)
    try:
        client = connect(url)
        probe.fail_at = probe.calls + 3
        expected = rf"{side} failed inside generate \(RuntimeError: injected failure\)\. The server keeps serving: try"
        with pytest.raises(AppError, match=expected):
            run(client, "Say hello.", "retrace", temperature=0.9)  # sampled: the failed call held the sampling lock
        assert wait_until(lambda: not generate_threads(), timeout=10)
        # the same slot, the sampling lock and the target's hooks all serve the next requests
        *_, sampled, status = run(client, "Say hello.", "retrace", temperature=0.9)
        assert status.startswith("Done") and sampled["drafted"]["new_tokens"] == MAX_NEW
        *_, greedy, _ = run(client, "Say hello.", "retrace")
        assert greedy["identical"] is True
    finally:
        blocks.close()


# ------------------------------------------------------------------------------------ a page others can reach


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2", "LOCALHOST"])
def test_loopback_hosts_are_private(host):
    from hf_retrace.demo.app import is_private

    assert is_private(host) and not is_private(host, share=True)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "demo.example.org"])
def test_other_hosts_are_not_private(host):
    from hf_retrace.demo.app import is_private

    assert not is_private(host)


def serve_on_every_interface(engine, **launch_kwargs):
    """The page served on 0.0.0.0 (reached here through 127.0.0.1); returns ``(blocks, url)``."""
    from hf_retrace.demo.app import build_app, launch

    blocks = build_app(engine, concurrency=1)
    port = free_port()
    launch(blocks, host="0.0.0.0", port=port, prevent_thread_lock=True, quiet=True, **launch_kwargs)
    return blocks, f"http://127.0.0.1:{port}/"


def drafter_box(blocks) -> dict:
    return next(c["props"] for c in blocks.config["components"] if c["props"].get("elem_id") == "hfr-drafter")


def test_a_page_beyond_localhost_loads_no_drafter_folders_unless_allowed(paths):
    from gradio_client.exceptions import AppError

    engine = load_engine(paths, warmup=False)
    assert engine.allow_custom_drafters  # on by default: launch() decides for the server it starts
    blocks, url = serve_on_every_interface(engine)
    try:
        client = connect(url)
        with pytest.raises(AppError, match="does not load other drafters.*--allow-custom-drafters"):
            run(client, "Hi", drafter=str(paths["drafter"]), max_new_tokens=4)
        assert drafter_box(blocks)["interactive"] is False
        assert run(client, "Hi", max_new_tokens=4)[5].startswith("Done")  # the loaded drafter still serves
    finally:
        blocks.close()
    blocks, url = serve_on_every_interface(engine, allow_custom_drafters=True)  # the operator allows it explicitly
    try:
        *_, summary, status = run(connect(url), "Hi", drafter=str(paths["drafter"]), max_new_tokens=4)
        assert status.startswith("Done") and drafter_box(blocks)["interactive"] is True
    finally:
        blocks.close()


def test_the_cli_leaves_drafter_folders_to_launch_unless_allowed(monkeypatch, paths):
    import hf_retrace.demo.app as app_module
    from hf_retrace.cli import main
    from hf_retrace.demo.engine import DemoEngine

    pytest.importorskip("gradio", reason="the demo extra is not installed: pip install 'hf-retrace[demo]'")
    calls = []
    monkeypatch.setattr(DemoEngine, "from_pretrained", classmethod(lambda cls, *args, **kwargs: kwargs))
    monkeypatch.setattr(app_module, "build_app", lambda engine, concurrency: engine)
    monkeypatch.setattr(app_module, "launch", lambda app, **kwargs: calls.append((app, kwargs)))
    args = ["demo", "--target", str(paths["target"]), "--drafter", str(paths["drafter"]), "--host", "0.0.0.0"]
    assert main(args) == 0 and main([*args, "--allow-custom-drafters"]) == 0
    (engine_kwargs, plain), (_, allowed) = calls
    assert "allow_custom_drafters" not in engine_kwargs
    assert plain["allow_custom_drafters"] is None and plain["host"] == "0.0.0.0"
    assert allowed["allow_custom_drafters"] is True
