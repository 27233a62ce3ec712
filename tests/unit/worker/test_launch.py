"""``dwdp worker`` startup checks and ``dwdp launch``: role rules before the model loads,
one-line termination messages, fail-together of a pod's local ranks."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dwdp.worker import main as worker_main
from dwdp.worker.main import WorkerOptions, check_launch, load_launch_config, run_worker

httpx = pytest.importorskip("httpx")


def _config(tmp_path: Path, *, model: str = "/nonexistent/model", **over) -> Path:
    doc = {
        "model": {"path": model, "servedName": "tiny"},
        "handleType": "shm",
        "dwdp": {"dwdpSize": 1, "enableDense": False},
        "serverPort": 18000,
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    path = tmp_path / f"launch-{len(list(tmp_path.glob('launch-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


DENSE = {"dwdp": {"dwdpSize": 4, "enableDense": True}}


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail loudly if startup gets as far as the model."""

    def boom(cfg):
        raise AssertionError("the model check ran: the role rule must refuse first")

    monkeypatch.setattr(worker_main, "check_model", boom)
    monkeypatch.delenv("DWDP_ROLE", raising=False)


def _run(tmp_path, config, role=None):
    term = tmp_path / "termination-log"
    code = run_worker(WorkerOptions(config=str(config), role=role, termination_log=str(term)))
    return code, term.read_text() if term.exists() else ""


@pytest.mark.parametrize(
    ("flag", "env"),
    [("generation", None), ("GEN0", None), (None, "generation"), (None, "gen0"), (None, "Gen0")],
)
def test_generation_with_dense_refused_before_the_model_loads(
    tmp_path, monkeypatch, no_model_load, flag, env
):
    if env is not None:
        monkeypatch.setenv("DWDP_ROLE", env)
    code, line = _run(tmp_path, _config(tmp_path, **DENSE), role=flag)
    assert code == 1
    assert line.count("\n") == 1
    assert "dwdp.enableDense" in line and "generation" in line
    assert "/nonexistent" not in line


def test_role_flag_wins_over_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DWDP_ROLE", "gen0")
    cfg = check_launch(load_launch_config(str(_config(tmp_path, **DENSE))), "CTX0")
    assert cfg.role.value == "context"
    monkeypatch.setenv("DWDP_ROLE", "bogus")
    with pytest.raises(worker_main.WorkerStartupError, match="role"):
        check_launch(load_launch_config(str(_config(tmp_path, **DENSE))), None)


def test_missing_context_role_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("DWDP_ROLE", raising=False)
    monkeypatch.setattr(worker_main, "_warned", set())
    cfg = load_launch_config(str(_config(tmp_path, **DENSE)))
    with caplog.at_level(logging.WARNING, logger="dwdp.worker.main"):
        check_launch(cfg, None)
        check_launch(cfg, None)
        check_launch(cfg, "aggregated")
    warnings = [r.getMessage() for r in caplog.records if "context" in r.getMessage()]
    assert len(warnings) == 2  # unset once, aggregated once
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dwdp.worker.main"):
        check_launch(cfg, "ctx0")
        monkeypatch.setenv("DWDP_ROLE", "CONTEXT")
        check_launch(cfg, None)
    assert not caplog.records


def test_kv_max_tokens_below_one_request_is_refused_before_anything_loads(
    tmp_path, checkpoint, monkeypatch
):
    """maxTokens below maxModelLen (the model's 512 here) can never serve a full request:
    refused at the checkpoint check, before the rendezvous and the load."""
    monkeypatch.setenv("DWDP_ROLE", "context")

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded: the kvCache rule must refuse first")

    monkeypatch.setattr(worker_main, "load_model", no_load)
    config = _config(tmp_path, model=str(checkpoint), kvCache={"maxTokens": 100})
    code, line = _run(tmp_path, config)
    assert code == 1
    assert line.startswith("checkpoint: KvPoolError: kvCache.maxTokens: 100 tokens"), line
    assert "maxModelLen 512" in line
    config = _config(tmp_path, model=str(checkpoint), maxModelLen=4096)
    code, line = _run(tmp_path, config)
    assert code == 1 and "maxModelLen: 4096 is more than the model's" in line, line


def test_a_kv_pool_below_one_request_fails_the_rank_naming_the_numbers(
    tmp_path, checkpoint, monkeypatch
):
    """A freeMemoryFraction that leaves fewer tokens than one maxModelLen request is refused
    when the pool is sized (after the load, before serving), with the ledger measured so
    far in the termination message."""
    monkeypatch.setenv("DWDP_ROLE", "context")
    config = _config(
        tmp_path,
        model=str(checkpoint),
        maxModelLen=256,
        kvCache={"freeMemoryFraction": 1e-9},
    )
    code, line = _run(tmp_path, config)
    assert code == 1
    assert line.startswith("engine: KvPoolError: kvCache: the KV cache pool holds "), line
    assert "less than one request of maxModelLen 256 tokens" in line
    assert "; memory GiB (host/device): peak_load " in line
    assert "replicated_weights " in line and "kv_pool 0.00/0.00" in line


def test_cuda_graphs_on_a_cpu_rank_stop_it_before_the_rendezvous(
    tmp_path, checkpoint, monkeypatch
):
    """engine.cudaGraphs true where the model runs on the cpu: one config line naming the
    field and the device, before the group is joined and the model loads; with DWDP on, the
    launch rule refuses it first, with the API's words."""
    monkeypatch.setenv("DWDP_ROLE", "generation")

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("the rank joined its group: cudaGraphs must refuse first")

    monkeypatch.setattr("dwdp.worker.rendezvous.join_group", no_rendezvous)
    config = _config(tmp_path, model=str(checkpoint), engine={"cudaGraphs": True})
    code, line = _run(tmp_path, config)
    assert code == 1
    assert line == (
        "config: CudaGraphsError: engine.cudaGraphs: CUDA graphs need a CUDA device; this "
        "rank runs on cpu; leave it unset or false (got true)\n"
    ), line
    monkeypatch.setenv("DWDP_ROLE", "context")
    config = _config(
        tmp_path, model=str(checkpoint), engine={"cudaGraphs": True}, dwdp={"dwdpSize": 2}
    )
    code, line = _run(tmp_path, config)
    assert code == 1
    assert line.startswith("config: LaunchError: launch refused: engine.cudaGraphs: "), line
    assert "the prefetch schedule runs host hooks around every MoE layer" in line


def test_engine_config_carries_speculative_resolved_once(tmp_path):
    """``engine.speculative`` of a DwdpDeployment's generation section reaches the engine's
    ``EngineConfig`` through the rendered launch config, vLLM's lookup defaults resolved;
    unset, the engine decodes without drafts."""
    from dwdp.api.deployment import launch_config_for, parse_deployment
    from dwdp.api.enums import Role
    from dwdp.worker.engine.speculative import SpeculativeConfig

    spec = parse_deployment({
        "apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpDeployment", "metadata": {"name": "s"},
        "spec": {"model": {"path": "/models/m"}, "image": "dwdp-worker:dev", "context": {},
                 "generation": {"engine": {"speculative": {"numSpeculativeTokens": 4,
                                                           "promptLookupMax": 3}}}},
    }).spec
    rendered = launch_config_for(spec, Role.GENERATION).to_yaml_dict()
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(rendered))
    config = worker_main.engine_config(load_launch_config(str(path)), 64, 256, False)
    assert config.speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=3, prompt_lookup_max=3)
    context = launch_config_for(spec, Role.CONTEXT)
    assert worker_main.engine_config(context, 64, 256, False).speculative is None


def test_bad_launch_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /x}\ndwdp: {numPrefetchSlots: 1}\n")
    code, line = _run(tmp_path, bad)
    assert code == 1 and "numPrefetchSlots" in line and line.count("\n") == 1
    code, line = _run(tmp_path, tmp_path / "missing.yaml")
    assert code == 1 and "missing.yaml" in line


# -- checkpoints that fail before DWDP setup ----------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dwdp_dev.worker.checkpoint import make_checkpoint

    return make_checkpoint("mixtral", tmp_path_factory.mktemp("ck") / "mx", num_experts=6)


def _break(src: Path, dst: Path, mutate) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_fail_with_one_line(tmp_path, checkpoint, monkeypatch):
    import torch

    def no_group(cfg):
        raise AssertionError("the group was joined: the checkpoint check must fail first")

    monkeypatch.setattr("dwdp.worker.rendezvous.join_group", no_group)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    cases = {
        "missing": (lambda t: t.pop(name), f"tensor {name} is missing"),
        "shape": (lambda t: t.__setitem__(name, torch.zeros(3, 3)), f"tensor {name} has shape"),
        "dtype": (lambda t: t.__setitem__(name, t[name].half()), f"tensor {name} has dtype"),
    }
    for case, (mutate, needle) in cases.items():
        broken = _break(checkpoint, tmp_path / case, mutate)
        code, line = _run(tmp_path, _config(tmp_path, model=str(broken)))
        assert code == 1, case
        assert needle in line and line.count("\n") == 1, line
    # an index that names a shard file that is not there
    import json

    from dwdp.worker.loading.validate import INDEX_FILE, read_headers

    indexed = tmp_path / "indexed"
    shutil.copytree(checkpoint, indexed)
    weight_map = dict.fromkeys(read_headers(indexed), "model.safetensors")
    weight_map[name] = "model-00002-of-00002.safetensors"
    (indexed / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    code, line = _run(tmp_path, _config(tmp_path, model=str(indexed)))
    assert code == 1 and line.count("\n") == 1, line
    assert f"shard file model-00002-of-00002.safetensors named by {INDEX_FILE} (tensor {name})" \
        in line, line
    # a config the partition cannot split: 6 experts over 8 ranks
    code, line = _run(tmp_path, _config(tmp_path, model=str(checkpoint), dwdp={"dwdpSize": 8}))
    assert code == 1 and "PartitionError" in line and line.count("\n") == 1, line


def test_architecture_without_dense_roots(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from dwdp_dev.worker.tokenizer import save_tokenizer

    config = transformers.OlmoeConfig(
        vocab_size=384,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    )
    path = tmp_path / "olmoe"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    save_tokenizer(path)
    monkeypatch.setenv("DWDP_ROLE", "context")
    code, line = _run(tmp_path, _config(tmp_path, model=str(path), **DENSE))
    assert code == 1
    assert "dwdp.enableDense" in line and "no dense roots" in line, line


# -- the launcher ---------------------------------------------------------------------------


def _free_base_port(count: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _launch(tmp_path, config, nproc, **env):
    term = tmp_path / "pod-termination-log"
    cmd = [
        sys.executable,
        "-m",
        "dwdp",
        "launch",
        "--config",
        str(config),
        "--nproc",
        str(nproc),
        "--host",
        "127.0.0.1",
        "--termination-log",
        str(term),
    ]
    full_env = {**os.environ, "DWDP_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", **env}
    full_env.pop("DWDP_ROLE", None)
    return subprocess.Popen(cmd, env=full_env), term


def _wait_ready(url: str, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the launcher exited early"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never became ready")


def test_launcher_serves_each_local_rank_and_fails_together(tmp_path, checkpoint):
    base = _free_base_port(2)
    config = _config(tmp_path, model=str(checkpoint), serverPort=base)
    proc, term = _launch(tmp_path, config, 2)
    try:
        for k in range(2):
            url = f"http://127.0.0.1:{base + k}"
            _wait_ready(url, proc)
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                timeout=60,
            )
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        children = _children(proc.pid)
        assert len(children) == 2
        victim = max(children)  # local rank 1 was started last
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code != 0
        line = term.read_text()
        assert "killed by signal 9" in line and line.count("\n") == 1
        for child in children:
            assert (
                not Path(f"/proc/{child}").exists()
                or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launcher_bad_checkpoint_exits_non_zero(tmp_path, checkpoint):
    broken = _break(checkpoint, tmp_path / "broken", lambda t: t.pop("model.norm.weight"))
    proc, term = _launch(tmp_path, _config(tmp_path, model=str(broken)), 2)
    code = proc.wait(timeout=240)
    assert code != 0
    line = term.read_text()
    assert "exited with status 1" in line and "tensor model.norm.weight is missing" in line


def test_launcher_stops_every_rank_on_sigterm(tmp_path, checkpoint):
    base = _free_base_port(1)
    proc, _term = _launch(tmp_path, _config(tmp_path, model=str(checkpoint), serverPort=base), 1)
    try:
        _wait_ready(f"http://127.0.0.1:{base}", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launcher_stopped_while_a_rank_waits_at_the_rendezvous_exits_0(tmp_path, checkpoint):
    """SIGTERM to the launcher of a pod whose rank waits at the rendezvous (rank 0 of a
    2-rank group whose rank 1 never comes): the launcher forwards it, the rank stops before
    serving (exit 0, its API process ended, no socket directory left), and the launcher exits
    0 with no termination message: a pod deleted while it starts is not a failure."""
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = _config(tmp_path, model=str(checkpoint), dwdp={"dwdpSize": 2})
    proc, term = _launch(tmp_path, config, 1, TMPDIR=str(tmpdir), DWDP_GROUP="g",
                         DWDP_INCARNATION="1", DWDP_RANK="0", DWDP_WORLD_SIZE="2",
                         DWDP_RENDEZVOUS=f"127.0.0.1:{port}", DWDP_RENDEZVOUS_TIMEOUT_S="120")
    try:
        deadline = time.monotonic() + 120
        while not list(tmpdir.glob("dwdp-rank-*")):  # the rank made its socket directory
            assert proc.poll() is None and time.monotonic() < deadline, "no rank started"
            time.sleep(0.2)
        (rank,) = _children(proc.pid)
        time.sleep(2)  # on to the rendezvous, where it waits for rank 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not term.exists() or term.read_text() == ""
        assert not list(tmpdir.glob("dwdp-rank-*"))
        assert not Path(f"/proc/{rank}").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the host gate, before the rendezvous -------------------------------------------------


def _rank_one_of_two(
    tmp_path: Path, config: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """Run ``dwdp worker`` as rank 1 of a 2-rank group whose rendezvous address has no
    listener (a rank that got that far would wait there and name the rendezvous), with
    ``env`` on top of this process's; returns the process and its termination message."""
    term = tmp_path / "termination-log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = {
        **{k: v for k, v in os.environ.items() if k != "DWDP_ROLE"},
        "DWDP_GROUP": "g",
        "DWDP_INCARNATION": "1",
        "DWDP_RANK": "1",
        "DWDP_WORLD_SIZE": "2",
        "DWDP_RENDEZVOUS": f"127.0.0.1:{port}",
        "DWDP_RENDEZVOUS_TIMEOUT_S": "30",
        **env,
    }
    cmd = [sys.executable, "-m", "dwdp", "worker", "--config", str(config)]
    proc = subprocess.run(
        [*cmd, "--termination-log", str(term)], env=full, capture_output=True, timeout=300
    )
    return proc, term.read_text() if term.exists() else ""


def test_cuda_backend_without_cuda_is_refused_before_the_rendezvous(tmp_path, checkpoint):
    """A real ``dwdp worker`` with handleType posixFd (the cuda backend) on a host where
    torch sees no CUDA device: refused by the host gate with the remedy in the termination
    message, before it joins the group (the rendezvous address has no listener: rank 1 would
    time out there and name the rendezvous) and before the model loads."""
    config = _config(
        tmp_path, model=str(checkpoint), handleType="posixFd", dwdp={"dwdpSize": 2}
    )
    proc, line = _rank_one_of_two(tmp_path, config, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    assert line.startswith("host: HostGateError: handleType: posixFd runs the cuda backend")
    assert "no CUDA device" in line and "handleType: shm" in line and line.count("\n") == 1
    assert b"rendezvous" not in proc.stderr.lower()


def test_fabric_without_an_imex_channel_is_refused_before_the_rendezvous(
    tmp_path, checkpoint
):
    """A real ``dwdp worker`` with handleType fabric in a container without an IMEX channel
    device (this host has no /dev/nvidia-caps-imex-channels): refused by the host gate naming
    the missing channel and the ComputeDomain remedy, before it joins the group."""
    from dwdp.worker.host import IMEX_CHANNEL_DIR, imex_channels

    assert imex_channels(IMEX_CHANNEL_DIR) == []
    config = _config(tmp_path, model=str(checkpoint), handleType="fabric", dwdp={"dwdpSize": 2})
    proc, line = _rank_one_of_two(tmp_path, config, {})
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    assert line.startswith(
        f"host: HostGateError: handleType: fabric needs an IMEX channel, and {IMEX_CHANNEL_DIR} "
        "holds no channel device"
    ), line
    assert "ComputeDomain" in line and "handleType: posixFd" in line and line.count("\n") == 1
    assert b"rendezvous" not in proc.stderr.lower()


def test_an_imex_channel_device_passes_the_channel_check(tmp_path):
    """With a character device ``channel0`` in the channel folder (as NVIDIA's DRA driver
    mounts it) the FABRIC gate goes on to CUDA: on this CPU host the refusal is the CUDA
    one; a regular file of that name is no channel."""
    from dwdp.api.launch import LaunchConfig
    from dwdp.worker.host import HostGateError, imex_channels, probe_host

    cfg = LaunchConfig.model_validate(
        {"model": {"path": str(tmp_path)}, "handleType": "fabric", "dwdp": {"dwdpSize": 2}}
    )
    (tmp_path / "channel0").write_bytes(b"")
    assert imex_channels(tmp_path) == []
    with pytest.raises(HostGateError, match="needs an IMEX channel"):
        probe_host(cfg, device=0, imex_dir=tmp_path)
    (tmp_path / "channel0").unlink()
    os.mknod(tmp_path / "channel0", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    assert imex_channels(tmp_path) == ["channel0"]
    with pytest.raises(HostGateError, match="torch sees no CUDA device"):
        probe_host(cfg, device=0, imex_dir=tmp_path)


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        ("DWDP_DENSE_MIN_BYTES", "1MiB", ">= 0"),
        ("DWDP_DENSE_MIN_BYTES", "\u00b2", ">= 0"),  # a digit to str.isdigit, not to int()
        ("DWDP_TORCH_THREADS", "0", ">= 1"),
    ],
)
def test_bad_worker_env_setting_is_refused_before_the_rendezvous(
    tmp_path, checkpoint, name, value, rule
):
    """The worker settings a DwdpDeployment may put in ``spec.env`` (api.contract.USER_ENV)
    with a value their variable does not take: a real ``dwdp worker`` refuses it as a config
    error naming the variable and its value, before it joins the group (no listener at the
    rendezvous address) and before the model loads."""
    config = _config(
        tmp_path, model=str(checkpoint), dwdp={"dwdpSize": 2, "enableDense": True}
    )
    proc, line = _rank_one_of_two(tmp_path, config, {name: value, "DWDP_ROLE": "context"})
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    assert line.startswith("config: WorkerEnvError: "), line
    assert f"{name}: {value!r} is not an integer {rule}" in line
    assert line.count("\n") == 1
    assert b"rendezvous" not in proc.stderr.lower()


def test_a_blank_api_key_is_refused_before_the_rendezvous(tmp_path, checkpoint, monkeypatch):
    """A DWDP_API_KEY with blanks around it (a Secret written with a newline) could never be
    sent back by a client: the rank refuses it as a config error, naming the variable."""
    monkeypatch.setenv("DWDP_ROLE", "context")
    monkeypatch.setenv("DWDP_API_KEY", "sk-123\n")
    code, line = _run(tmp_path, _config(tmp_path, model=str(checkpoint)))
    assert code == 1
    assert line.startswith("config: ApiKeyError: DWDP_API_KEY: the API key has leading"), line


def test_a_temporary_folder_too_long_for_the_ranks_sockets_is_refused_before_the_rendezvous(
    tmp_path, checkpoint, monkeypatch
):
    """The rank's engine link and app listen on Unix sockets under TMPDIR, whose paths have a
    bound of 107 bytes: a longer folder is a config error naming TMPDIR, before the group is
    joined and the model loads (not a failure once the model has loaded)."""
    import tempfile

    long_dir = tmp_path / ("t" * 100)
    long_dir.mkdir()
    monkeypatch.setenv("DWDP_ROLE", "context")
    monkeypatch.setenv("TMPDIR", str(long_dir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("the rank joined its group: the TMPDIR check must refuse first")

    monkeypatch.setattr("dwdp.worker.rendezvous.join_group", no_rendezvous)
    code, line = _run(tmp_path, _config(tmp_path, model=str(checkpoint)))
    assert code == 1
    assert line.startswith(f"config: ValueError: TMPDIR: the temporary folder '{long_dir}' is "
                           "too long for the rank's Unix sockets"), line
    assert "the bound is 107" in line, line


@pytest.fixture
def api_processes(monkeypatch) -> list[subprocess.Popen]:
    """The API server processes the rank starts (``subprocess.Popen`` recorded)."""
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        if "dwdp.worker.server.api_process" in " ".join(map(str, proc.args)):
            started.append(proc)
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    return started


def test_a_rank_that_fails_after_starting_its_api_process_leaves_nothing_behind(
    tmp_path, checkpoint, monkeypatch, api_processes
):
    """The API server process starts at the config stage (it loads the tokenizer while the
    model loads); a rank that fails later (here: a KV pool below one request, at the engine
    stage) ends it and removes its socket directory."""
    import tempfile

    monkeypatch.setenv("DWDP_ROLE", "context")
    config = _config(tmp_path, model=str(checkpoint), maxModelLen=256,
                     kvCache={"freeMemoryFraction": 1e-9})
    code, line = _run(tmp_path, config)
    assert code == 1 and line.startswith("engine: KvPoolError"), line
    (api,) = api_processes
    assert api.returncode is not None, "the API process still runs"
    assert not list(Path(tempfile.gettempdir()).glob(f"dwdp-rank-{os.getpid()}-*"))


def test_an_api_process_that_dies_while_the_model_loads_fails_the_rank_after_the_load(
    tmp_path, checkpoint, monkeypatch, api_processes
):
    """Killed during the load, the API process fails the rank at the load stage, naming it,
    before the DWDP setup and the engine (not once the engine is ready to serve)."""
    real_load = worker_main.load_rank

    def load_then_kill(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        (api,) = api_processes
        api.kill()
        api.wait()
        return loaded

    def no_setup(*args, **kwargs):
        raise AssertionError("the DWDP setup ran: the dead API process must fail the rank first")

    monkeypatch.setattr(worker_main, "load_rank", load_then_kill)
    monkeypatch.setattr("dwdp.worker.bringup.setup_dwdp", no_setup)
    monkeypatch.setenv("DWDP_ROLE", "context")
    code, line = _run(tmp_path, _config(tmp_path, model=str(checkpoint)))
    assert code == 1
    assert line.startswith("load: RuntimeError: the API server process exited with status -9"), line


def test_a_rank_stopped_while_its_model_loads_exits_0_and_leaves_nothing_behind(
    tmp_path, checkpoint, monkeypatch, api_processes
):
    """SIGTERM during the load (a pod deleted while it starts): the rank stops where it is,
    ends its API process, removes its socket directory, writes no termination message (it did
    not fail) and exits 0; a second signal during its teardown is ignored; its process's
    signal handlers are as they were afterwards."""
    import tempfile

    from dwdp.worker.server.run import ApiProcess

    def signalled_load(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the load goes on: the signal's handler stops it here
        raise AssertionError("the load ran on after SIGTERM")  # (a failure: status 1)

    def no_setup(*args, **kwargs):
        raise AssertionError("the DWDP setup ran after SIGTERM")

    real_close = ApiProcess.close

    def close_signalled_again(self):
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's follow-up, mid-teardown
        time.sleep(0.2)
        real_close(self)

    monkeypatch.setattr(worker_main, "load_rank", signalled_load)
    monkeypatch.setattr("dwdp.worker.bringup.setup_dwdp", no_setup)
    monkeypatch.setattr(ApiProcess, "close", close_signalled_again)
    monkeypatch.setenv("DWDP_ROLE", "context")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    code, line = _run(tmp_path, _config(tmp_path, model=str(checkpoint)))
    assert code == 0 and line == ""
    (api,) = api_processes
    assert api.returncode is not None, "the API process still runs"
    assert not list(Path(tempfile.gettempdir()).glob(f"dwdp-rank-{os.getpid()}-*"))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.parametrize("secret", [None, b"short"])
def test_a_missing_or_short_rendezvous_secret_is_a_config_error(tmp_path, checkpoint, secret):
    """A DWDP rank whose DWDP_RENDEZVOUS_SECRET_FILE is unset, or names a file shorter than
    32 bytes: a real ``dwdp worker`` stops with one ``config:`` line naming the variable
    (and the path), before it joins the group."""
    config = _config(tmp_path, model=str(checkpoint), dwdp={"dwdpSize": 2})
    env = {}
    if secret is not None:
        path = tmp_path / "secret"
        path.write_bytes(secret)
        env["DWDP_RENDEZVOUS_SECRET_FILE"] = str(path)
    proc, line = _rank_one_of_two(tmp_path, config, env)
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    if secret is None:
        assert line.startswith("config: RendezvousSecretError: environment variable "
                               "DWDP_RENDEZVOUS_SECRET_FILE is not set"), line
    else:
        assert line.startswith(f"config: RendezvousSecretError: DWDP_RENDEZVOUS_SECRET_FILE="
                               f"'{path}' holds 5 bytes"), line
    assert line.count("\n") == 1


# -- kvTransfer.vllm: a KV cache vLLM's decode servers cannot share, before the rendezvous ---

VLLM = {"kvTransfer": {"vllm": {"sideChannelPort": 5600}}}


def test_a_head_size_vllm_cannot_take_stops_the_rank_before_the_rendezvous(tmp_path, checkpoint):
    """A real ``dwdp worker`` (context, expert + dense DWDP) with kvTransfer.vllm over a model
    whose head_dim (8) vLLM's CPU attention cannot take: one config line naming the field, the
    value and the head sizes served, before it joins the group (the rendezvous address has no
    listener and the secret is valid: a rank that got that far would wait there)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    config = _config(tmp_path, model=str(checkpoint), dwdp={"dwdpSize": 2, "enableDense": True},
                     **VLLM)
    proc, line = _rank_one_of_two(tmp_path, config, {
        "DWDP_ROLE": "context", "DWDP_RENDEZVOUS_SECRET_FILE": str(secret)})
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    assert line == (
        "config: VllmInteropError: kvTransfer.vllm: the model's head_dim 8; vLLM's CPU_ATTN "
        "(vec) blocks are staged for head sizes 32, 64, 96, 128, 160, 192, 224, 256, 512 "
        "only\n"), line
    assert b"rendezvous" not in proc.stderr.lower()


def test_multi_head_latent_attention_is_refused_for_vllm_before_the_rendezvous(
    tmp_path, monkeypatch
):
    """DeepSeek-V3's latent KV cache is not what vLLM's decode servers read from a staged
    block: the rank names kv_lora_rank before it joins the group."""
    from dwdp_dev.worker.checkpoint import make_checkpoint

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("the rank joined its group: kvTransfer.vllm must refuse first")

    monkeypatch.setattr("dwdp.worker.rendezvous.join_group", no_rendezvous)
    monkeypatch.setenv("DWDP_ROLE", "context")
    ckpt = make_checkpoint("deepseek_v3", tmp_path / "ds", num_experts=4)
    code, line = _run(tmp_path, _config(tmp_path, model=str(ckpt), dwdp={"dwdpSize": 2}, **VLLM))
    assert code == 1
    assert line.startswith("config: VllmInteropError: kvTransfer.vllm: the model uses "
                           "multi-head latent attention (kv_lora_rank "), line
    assert line.count("\n") == 1


def test_the_vllm_check_passes_a_model_vllm_can_share_and_refuses_a_device_cache(tmp_path):
    """check_vllm_interop: a head_dim-32 model in float32 or bfloat16 passes; a rank whose
    cache would be on a GPU is refused (only vLLM's CPU attention layout is staged); without
    kvTransfer.vllm nothing is checked."""
    from dwdp.worker.disagg.vllm_nixl import VllmInteropError
    from dwdp.worker.main import check_vllm_interop
    from dwdp_dev.worker.checkpoint import tiny_config

    config = tiny_config("qwen3_moe", vocab_size=64, num_experts=4, num_layers=2,
                         hidden_size=64, dtype="float32", head_dim=32)
    cfg = load_launch_config(str(_config(tmp_path, model="/m", **VLLM)))
    for dtype in ("auto", "bfloat16"):
        model = cfg.model.model_copy(update={"dtype": dtype})
        check_vllm_interop(cfg.model_copy(update={"model": model}), config, "cpu")
    with pytest.raises(VllmInteropError, match=r"^kvTransfer.vllm: this rank's KV cache would "
                       r"be on cuda:0; only vLLM's CPU attention layout is staged"):
        check_vllm_interop(cfg, config, "cuda:0")
    narrow = tiny_config("qwen3_moe", vocab_size=64, num_experts=4, num_layers=2,
                         hidden_size=64, dtype="float32", head_dim=16)
    with pytest.raises(VllmInteropError, match="the model's head_dim 16; "):
        check_vllm_interop(cfg, narrow, "cpu")
    check_vllm_interop(load_launch_config(str(_config(tmp_path, model="/m"))), narrow, "cuda:0")


def _mtp_demo_greedy(question: str) -> tuple[Path, list[int], list[int]]:
    """The demo model with its MTP layer (cached), the question's prompt ids and
    transformers' greedy answer to it (12 tokens, up to EOS)."""
    import torch

    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.devcluster.paths import cache_dir
    from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model

    path = cached_demo_mtp_model(cache_dir() / "models")
    model, tok = load_checkpoint(path)
    prompt = tok(question)["input_ids"]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    answer = out[0, len(prompt):].tolist()
    if tok.eos_token_id in answer:
        answer = answer[: answer.index(tok.eos_token_id)]
    return path, prompt, answer


def test_a_rank_drafting_with_the_checkpoints_mtp_layer_answers_as_transformers(tmp_path):
    """``engine.speculative.method: mtp`` on the demo model with its trained MTP layer: the
    rank loads the layer, its greedy answer is transformers' ``generate``'s, and its metrics
    and status count the drafts it accepted."""
    path, prompt, want_ids = _mtp_demo_greedy("What is the capital of France?")
    base = _free_base_port(1)
    config = _config(tmp_path, model=str(path), serverPort=base,
                     engine={"speculative": {"method": "mtp", "numSpeculativeTokens": 2}})
    proc, _ = _launch(tmp_path, config, 1)
    try:
        url = f"http://127.0.0.1:{base}"
        _wait_ready(url, proc)
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want_ids
        status = httpx.get(url + "/dwdp/status", timeout=10).json()["speculative"]
        assert status["method"] == "mtp" and status["accepted_tokens"] > 0
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{' in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_context_and_a_generation_rank_drafting_with_mtp_decode_across_the_transfer(
        tmp_path):
    """A context rank and a generation rank launched with ``engine.speculative.method: mtp``:
    the context rank prefills (``do_remote_decode``), the generation rank reads the prompt's KV
    (both agents describe the MTP layer: a layout that differs fails the read), answers as
    transformers' ``generate`` and accepts drafts. ``test_disagg`` checks the MTP KV read."""
    path, prompt, want_ids = _mtp_demo_greedy("What is the capital of Japan?")
    mtp = {"speculative": {"method": "mtp", "numSpeculativeTokens": 2}}
    ranks = []
    try:
        for role in ("context", "generation"):
            base = _free_base_port(1)
            config = _config(tmp_path, model=str(path), serverPort=base, role=role, engine=mtp)
            ranks.append((f"http://127.0.0.1:{base}", _launch(tmp_path, config, 1)[0]))
        for url, proc in ranks:
            _wait_ready(url, proc)
        (ctx, _), (gen, _) = ranks
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        pre = httpx.post(ctx + "/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert pre.status_code == 200, pre.text
        r = httpx.post(gen + "/v1/completions", timeout=60, json={
            **body, "kv_transfer_params": pre.json()["kv_transfer_params"]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want_ids
        status = httpx.get(gen + "/dwdp/status", timeout=10).json()["speculative"]
        assert status["accepted_tokens"] > 0, status
    finally:
        for _, proc in ranks:
            proc.terminate()
        for _, proc in ranks:
            proc.wait(timeout=60)


def test_mtp_on_a_checkpoint_without_the_layer_stops_the_rank_in_one_line(tmp_path, checkpoint):
    config = _config(tmp_path, model=str(checkpoint),
                     engine={"speculative": {"method": "mtp", "numSpeculativeTokens": 1}})
    code, term = _run(tmp_path, config, role="generation")
    assert code != 0
    assert "engine.speculative.method: needs the checkpoint's multi-token prediction layer" \
        in term and term.count("\n") <= 1, term
