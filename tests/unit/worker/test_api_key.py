"""The HTTP trust boundary of a rank: the API key on ``/v1/*`` (open probes and scraping),
request bodies bounded, and the key's configuration checked (real uvicorn, real HTTP)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from dwdp.worker.apikey import ApiKey, ApiKeyError, check_api_key
from dwdp.worker.server.guard import MAX_BODY_BYTES

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
from _http_helpers import UvicornThread, schemathesis_run  # noqa: E402

httpx = pytest.importorskip("httpx")

from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.server.app import build_app  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "m", seed=5)
    model, tok = load_checkpoint(path)
    engine = ContinuousEngine(model, tok, model_name="m").start()
    app = build_app(engine, api_key=KEY, on_shutdown=engine.stop)
    with UvicornThread(app, graceful_shutdown_timeout_s=None) as base:
        yield base


BODY = {"prompt": "Hello", "max_tokens": 2}


def test_v1_needs_the_key(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(keyed + "/v1/completions", json=BODY, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert "API key" in r.json()["error"]["message"]
        assert httpx.get(keyed + "/v1/models", headers=headers, timeout=30).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(keyed + "/v1/completions", json=BODY, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(keyed + "/v1/models", headers=auth, timeout=30).status_code == 200


def test_probes_metrics_and_status_stay_open(keyed):
    for path in ("/health", "/ready", "/metrics", "/dwdp/status"):
        assert httpx.get(keyed + path, timeout=30).status_code == 200, path


def test_an_oversized_body_is_refused_with_413_naming_the_limit(keyed):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    r = httpx.post(keyed + "/v1/completions", content=big, headers=auth, timeout=60)
    assert r.status_code == 413
    assert f"at most {MAX_BODY_BYTES} bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the bound applies while the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b"a" * 2**20
        yield b'"}'

    r = httpx.post(keyed + "/v1/completions", content=chunks(), headers=auth, timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]
    # the server still serves
    r = httpx.post(keyed + "/v1/completions", json=BODY, headers=auth, timeout=60)
    assert r.status_code == 200


def test_a_lying_content_length_does_not_hang_or_crash_the_server(keyed):
    host, port = keyed.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 999999999999\r\n\r\n{}"
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert httpx.get(keyed + "/health", timeout=30).status_code == 200


def test_the_key_setting_is_checked():
    assert check_api_key(None, "DWDP_API_KEY") is None
    assert check_api_key("", "DWDP_API_KEY") is None
    assert check_api_key("k1", "DWDP_API_KEY") == "k1"
    for bad in ("  ", " k1", "k1\n"):
        with pytest.raises(ApiKeyError, match="DWDP_API_KEY: the API key has leading"):
            check_api_key(bad, "DWDP_API_KEY")


def _swap(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_a_key_file_is_re_read_when_it_changes_and_a_broken_one_keeps_the_key(tmp_path, caplog):
    """DWDP_API_KEY_FILE wins over DWDP_API_KEY; a changed file is the key from its next look
    on; an empty, blank-padded or deleted file keeps the last key (an ERROR naming the file),
    so a broken rotation never turns the key off."""
    path = tmp_path / "key"
    path.write_text("k1")
    env = {"DWDP_API_KEY_FILE": str(path), "DWDP_API_KEY": "from-env"}
    key = ApiKey.from_env(env, file_var="DWDP_API_KEY_FILE", value_var="DWDP_API_KEY")
    key.recheck_s = 0.0
    assert key.required and key.current() == "k1"
    _swap(path, "k2")
    assert key.current() == "k2"
    for broken in ("", "k3\n"):
        _swap(path, broken)
        assert key.current() == "k2"
    path.unlink()
    assert key.current() == "k2"
    assert f"API key not changed: {path}" in caplog.text
    _swap(path, "k4")
    assert key.current() == "k4"
    slow = ApiKey(path=path, recheck_s=3600.0)
    _swap(path, "k5")
    assert slow.current() == "k4"  # looked at most once per recheck_s
    with pytest.raises(ApiKeyError, match=f"{tmp_path / 'none'}: cannot read the API key"):
        ApiKey(path=tmp_path / "none")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ApiKeyError, match="the API key file is empty"):
        ApiKey(path=tmp_path / "empty")
    plain = ApiKey.from_env({"DWDP_API_KEY": "v"}, file_var="DWDP_API_KEY_FILE",
                            value_var="DWDP_API_KEY")
    assert plain.current() == "v" and not ApiKey.from_env(
        {}, file_var="DWDP_API_KEY_FILE", value_var="DWDP_API_KEY").required


def test_schemathesis_with_the_key_finds_no_server_error(keyed):
    """The whole API fuzzed with the key on: no 5xx; the key is what lets /v1/* through."""
    statuses, failures = schemathesis_run(keyed, {"Authorization": f"Bearer {KEY}"}, examples=15)
    assert not failures, failures[:5]
    # random bodies may all be invalid (a 400): the key's effect is that none is a 401
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert statuses[path] and 401 not in statuses[path], (path, statuses[path])
    assert 200 in statuses["/v1/models"]
