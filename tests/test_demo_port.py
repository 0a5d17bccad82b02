"""``hf-retrace demo`` keeps gradio's conventions: with ``--host`` / ``--port`` unset, ``GRADIO_SERVER_NAME`` and
``GRADIO_SERVER_PORT`` decide (else 127.0.0.1 and the first free port from 7860); a flag wins over them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from hf_retrace.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Run ``hf-retrace demo`` with the engine, the page and the server stubbed: returns what launch() was given."""
    pytest.importorskip("gradio", reason="the demo extra is not installed: pip install 'hf-retrace[demo]'")
    import hf_retrace.demo.app as app
    import hf_retrace.demo.engine as engine

    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    (tmp_path / "target").mkdir()
    calls = []
    monkeypatch.setattr(engine.DemoEngine, "from_pretrained", classmethod(lambda cls, *a, **k: object()))
    monkeypatch.setattr(app, "build_app", lambda engine, concurrency: types.SimpleNamespace())
    monkeypatch.setattr(app, "launch", lambda page, **kwargs: calls.append(kwargs))
    for name in ("GRADIO_SERVER_PORT", "GRADIO_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)

    def run(*flags: str) -> dict | int:
        code = main(["demo", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), *flags])
        return calls.pop() if code == 0 else code

    return run


def test_unset_flags_leave_host_and_port_to_gradio_and_a_flag_wins(launched, monkeypatch):
    assert launched()["host"] is None and launched()["port"] is None  # gradio then reads its variables
    monkeypatch.setenv("GRADIO_SERVER_PORT", "7999")
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    assert (launched()["host"], launched()["port"]) == (None, None)
    given = launched("--host", "127.0.0.1", "--port", "8123")
    assert (given["host"], given["port"]) == ("127.0.0.1", 8123)


def test_a_gradio_server_port_that_is_no_port_is_refused_in_one_line(launched, monkeypatch, capsys):
    monkeypatch.setenv("GRADIO_SERVER_PORT", "http")
    assert launched() == 2
    assert "GRADIO_SERVER_PORT='http' is not a port in 1..65535; unset it or pass --port." in capsys.readouterr().err
    assert launched("--port", "0") == 2


def test_the_drafter_folder_box_follows_gradio_server_name(monkeypatch):
    from hf_retrace.demo.app import is_private

    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    assert not is_private(None) and is_private("127.0.0.1")
    monkeypatch.setenv("GRADIO_SERVER_NAME", "localhost")
    assert is_private(None)


@pytest.mark.slow
def test_a_real_server_listens_where_gradio_s_variables_say(tmp_path):
    """A real gradio server in a fresh process (gradio reads its variables when imported): GRADIO_SERVER_PORT is
    honoured with the port left unset, and a given port wins."""
    pytest.importorskip("gradio", reason="the demo extra is not installed: pip install 'hf-retrace[demo]'")
    script = textwrap.dedent(
        """
        import sys
        import gradio as gr
        from hf_retrace.demo.app import launch
        port = None if sys.argv[1] == "unset" else int(sys.argv[1])
        with gr.Blocks() as page:
            gr.Markdown("hi")
        launch(page, port=port, prevent_thread_lock=True, quiet=True)
        print("LISTENING", page.server_name, page.server_port)
        page.close()
        """
    )
    env_port, flag_port = _free_port(), _free_port()
    env = dict(os.environ, GRADIO_SERVER_PORT=str(env_port), GRADIO_SERVER_NAME="127.0.0.1",
               GRADIO_ANALYTICS_ENABLED="False")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for port, expected in (("unset", env_port), (str(flag_port), flag_port)):
        proc = subprocess.run([sys.executable, "-c", script, port], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"LISTENING 127.0.0.1 {expected}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
