"""A rank serves HTTP from an API server process apart from its engine (``dwdp.worker.server.
api_process``): real processes, real HTTP, the ZMQ link between them.

What it must keep of a rank served in one process: answers and streams (logprobs, cached
tokens), a client that leaves aborts its request, one ``/metrics`` page with the families of
both processes, the rank's own routes, SIGTERM draining streams in flight; and what a second
process adds: either process dying takes the other down, and the rank's exit names why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
from _pods import launched_pod  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

API_MODULE = "dwdp.worker.server.api_process"


def _launch(ckpt: Path) -> dict:
    return {
        "model": {"path": str(ckpt), "servedName": "tiny"},
        "gracefulShutdownTimeoutSeconds": 30,
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "ck", num_experts=4,
                           seed=3)


@pytest.fixture(scope="module")
def pod(tmp_path_factory, ckpt):
    with launched_pod(tmp_path_factory.mktemp("pod"), _launch(ckpt), 1) as (proc, urls, _, term):
        yield proc, urls[0], term


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(p) for p in text]
    return found


def _api_process(launcher: int) -> tuple[int, int]:
    """``(rank pid, API process pid)`` under the ``dwdp launch`` process ``launcher``."""
    for rank in _children(launcher):
        for child in _children(rank):
            if API_MODULE in Path(f"/proc/{child}/cmdline").read_text().replace("\0", " "):
                return rank, child
    raise AssertionError(f"no {API_MODULE} process under the launcher {launcher}")


def _listening_inode(port: int) -> str:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels or set(s.labels) == {"model_name"}}


def test_the_port_is_held_by_the_api_process_not_the_rank(pod):
    proc, url, _ = pod
    rank, api = _api_process(proc.pid)
    inode = _listening_inode(int(url.rsplit(":", 1)[1]))
    assert inode in _socket_inodes(api)
    assert inode not in _socket_inodes(rank)


def test_answers_stream_and_report_cached_tokens_through_the_link(pod):
    _, url, _ = pod
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    plain = _complete(url, prompt=prompt, max_tokens=6, temperature=0, logprobs=2).json()
    again = _complete(url, prompt=prompt, max_tokens=6, temperature=0).json()
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]
    assert len(plain["choices"][0]["logprobs"]["top_logprobs"]) == 6
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16

    text, usage = "", None
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            text += "".join(c["text"] for c in event["choices"])
            usage = event.get("usage") or usage
    assert text == plain["choices"][0]["text"]
    assert usage["completion_tokens"] == 6


def test_refusals_keep_their_status_and_field(pod):
    _, url, _ = pod
    too_long = _complete(url, prompt=[1] * 600, max_tokens=1)
    assert too_long.status_code == 400
    assert "prompt (600 tokens)" in too_long.json()["error"]["message"]
    bad_id = _complete(url, prompt=[10 ** 9], max_tokens=1)
    assert bad_id.status_code == 400
    assert "outside the vocabulary" in bad_id.json()["error"]["message"]


def test_the_ranks_own_routes_and_one_metrics_page(pod):
    _, url, _ = pod
    assert httpx.get(url + "/ready", timeout=10).json() == {"status": "ready"}
    assert httpx.get(url + "/dwdp/status", timeout=10).json()["phase"] == "disabled"
    assert httpx.get(url + "/no/such/route", timeout=10).status_code == 404
    _complete(url, prompt="hello", max_tokens=2)
    text = httpx.get(url + "/metrics", timeout=10).text
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "a family on the page twice"
    for family in ("dwdp_requests", "dwdp_time_to_first_token_seconds", "dwdp_prompt_tokens",
                   "vllm:num_requests_running", "vllm:time_to_first_token_seconds",
                   "vllm:cache_config_info"):
        assert family in names


def test_a_client_that_leaves_aborts_its_request(pod):
    _, url, _ = pod
    before = _metrics(url)["dwdp_generation_tokens_total"]
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "count with me", "temperature": 0, "max_tokens": 480,
        "ignore_eos": True, "stream": True,
    }) as answer:
        next(answer.iter_lines())  # the stream started; the client leaves
    deadline = time.monotonic() + 30
    while _metrics(url)["dwdp_num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the request still runs"
        time.sleep(0.1)
    assert _metrics(url)["dwdp_generation_tokens_total"] - before < 480


def test_sigterm_drains_a_stream_in_flight_then_both_exit(tmp_path, ckpt):
    with launched_pod(tmp_path, _launch(ckpt), 1) as (proc, urls, _, _term):
        rank, api = _api_process(proc.pid)
        reasons = []
        with httpx.stream("POST", urls[0] + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "drain", "max_tokens": 200, "ignore_eos": True,
            "stream": True,
        }) as answer:
            for line in answer.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if not reasons:
                    proc.send_signal(signal.SIGTERM)  # the launcher passes it to its ranks
                reasons.append(json.loads(line[len("data: "):])["choices"][0]["finish_reason"])
        assert reasons[-1] == "length" and len(reasons) == 200
        assert proc.wait(60) == 0
        assert not Path(f"/proc/{api}").exists() and not Path(f"/proc/{rank}").exists()


def test_a_stream_still_running_at_the_graceful_bound_ends_with_an_error_event(tmp_path, ckpt):
    """Past ``gracefulShutdownTimeoutSeconds`` a stream is ended, not cut: an error event naming
    the setting, then ``[DONE]``; and both processes exit 0."""
    slow = make_checkpoint("qwen3_moe", tmp_path / "ck", num_experts=8, seed=3, num_layers=8,
                           hidden_size=512, moe_width=512, head_dim=64)  # 480 tokens: ~3 s
    launch = {**_launch(slow), "gracefulShutdownTimeoutSeconds": 1}
    with launched_pod(tmp_path, launch, 1) as (proc, urls, _, _term):
        with _stream_started(urls[0], "too long", 480, timeout=60) as lines:
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert "gracefulShutdownTimeoutSeconds" in error["message"] and error["code"] == 503
        assert proc.wait(60) == 0


def test_the_rank_fails_naming_its_api_process_when_that_dies(tmp_path, ckpt):
    with launched_pod(tmp_path, _launch(ckpt), 1) as (proc, _urls, _, term):
        _rank, api = _api_process(proc.pid)
        os.kill(api, signal.SIGKILL)
        assert proc.wait(60) != 0
        assert "the API server process exited with status -9" in term.read_text()


@contextlib.contextmanager
def _stream_started(url: str, prompt: str, max_tokens: int, *, timeout: float):
    """The lines of a streaming completion of ``max_tokens`` tokens, its first event read."""
    with httpx.stream("POST", url + "/v1/completions", timeout=timeout, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True,
    }) as answer:
        lines = answer.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        yield lines


def test_a_ctrl_c_to_the_whole_group_still_drains_and_exits_0(tmp_path, ckpt):
    """A terminal's Ctrl-C reaches the launcher and the rank at once (the API process has a
    process group of its own: the rank stops it), and the launcher follows with SIGTERM to its
    ranks: the rank keeps its handlers until its API process has drained, so no second signal
    cuts it down."""
    with launched_pod(tmp_path, _launch(ckpt), 1) as (proc, urls, _, term):
        rank, api = _api_process(proc.pid)
        assert os.getpgid(api) == api != os.getpgid(rank)
        with _stream_started(urls[0], "interrupt", 200, timeout=120) as lines:
            for pid in (proc.pid, rank):  # the process group, as the terminal sends it
                os.kill(pid, signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0, term.read_text() if term.exists() else "no termination log"


def test_the_api_process_ends_with_its_rank(tmp_path, ckpt):
    """A killed rank: the API process ends the stream in flight with an error event and
    ``[DONE]`` (not a connection left hanging), removes the rank's socket directory and stops."""
    with launched_pod(tmp_path, _launch(ckpt), 1) as (proc, urls, _, _term):
        rank, api = _api_process(proc.pid)
        rank_dir = _rank_dir(rank)
        with _stream_started(urls[0], "cut short", 480, timeout=30) as lines:
            os.kill(rank, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert f"pid {rank}" in error["message"] and error["code"] == 503, error
        deadline = time.monotonic() + 20
        while Path(f"/proc/{api}").exists() and "zombie" not in _state(api):
            assert time.monotonic() < deadline, "the API process outlived its rank"
            time.sleep(0.2)
        assert not rank_dir.exists(), "the killed rank's socket directory was left"


def _rank_dir(rank: int) -> Path:
    """The rank's private socket directory (``dwdp-rank-<pid>-*`` in the temporary folder)."""
    import tempfile

    (found,) = Path(tempfile.gettempdir()).glob(f"dwdp-rank-{rank}-*")
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return "zombie"
