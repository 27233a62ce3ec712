"""The operator's non-planning parts that need no cluster: certificates, kopf settings,
the rank probe (against the test rank program's HTTP server) and the CLI's light import."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ports import free_port, free_port_block

from dwdp.api.enums import Role
from dwdp.operator import constants as c
from dwdp.operator.observe import ObservedPod, RankReport
from dwdp.operator.probe import probe_ranks, to_probe


def test_webhook_certificates_chain_and_names(tmp_path: Path) -> None:
    from cryptography import x509

    from dwdp.operator.certs import make_webhook_certs

    files = make_webhook_certs(tmp_path, ["127.0.0.1", "dwdp-operator.dwdp.svc"])
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["dwdp-operator.dwdp.svc"]
    assert oct(files.key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError):
        make_webhook_certs(tmp_path, [])


def test_temporary_webhook_certs_are_removed_on_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from dwdp.operator.certs import TEMP_PREFIX, temporary_webhook_certs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with temporary_webhook_certs(["127.0.0.1"]) as files:
        assert files.key.is_file() and files.key.parent.name.startswith(TEMP_PREFIX)
    with pytest.raises(RuntimeError), temporary_webhook_certs(["127.0.0.1"]):
        raise RuntimeError("the operator failed")
    assert list(tmp_path.iterdir()) == []


def _operator_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``dwdp operator`` whose apiserver (127.0.0.1, a closed port)
    never answers, with its own temporary directory ``tmp_path/tmp``."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "TMPDIR": str(tmp_path / "tmp")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env


def _dwdp() -> str:
    return str(Path(sys.executable).with_name("dwdp"))


def test_operator_removes_its_webhook_certificates_when_it_fails(tmp_path: Path) -> None:
    env = _operator_env(tmp_path)
    env["KUBECONFIG"] = str(tmp_path / "missing")  # no credentials: exit 1 after the certs
    out = subprocess.run(
        [_dwdp(), "operator", "--webhook-listen", "127.0.0.1:9443"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "no cluster credentials" in out.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("standby", [False, True], ids=["kopf", "standby"])
def test_operator_removes_its_webhook_certificates_on_sigterm(
    tmp_path: Path, standby: bool
) -> None:
    """Stopped by SIGTERM, in kopf (which handles the signal) or as a standby waiting for
    the Lease (before kopf runs), the operator exits 0 and leaves no certificate folder."""
    import signal

    env = _operator_env(tmp_path)
    live = free_port()
    args = [
        _dwdp(),
        "operator",
        "--liveness",
        f"http://127.0.0.1:{live}/healthz",
        "--webhook-listen",
        f"127.0.0.1:{free_port()}",
    ]
    if standby:
        args.append("--leader-elect")
    tmp = tmp_path / "tmp"
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not any((d / "tls.key").is_file() for d in tmp.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        if standby:  # the standby's liveness answers while it waits for the Lease
            while True:
                try:
                    socket.create_connection(("127.0.0.1", live), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None and time.monotonic() < deadline
                    time.sleep(0.1)
        else:
            time.sleep(1.0)  # let kopf start and take SIGTERM over
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    assert list(tmp.iterdir()) == [], output[-3000:]


def test_kopf_settings() -> None:
    import kopf

    from dwdp.operator.handlers import OperatorConfig, build_settings

    settings = kopf.OperatorSettings()
    build_settings(settings, OperatorConfig())
    assert settings.persistence.finalizer == "dwdp.io/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.StatusProgressStorage)
    assert settings.persistence.progress_storage.field == ("status", "kopf")
    assert settings.persistence.diffbase_storage.prefix == "dwdp.io"
    assert settings.watching.server_timeout == 300
    assert settings.watching.client_timeout == 330
    assert settings.peering.standalone is True
    assert settings.scanning.disabled is True
    assert settings.posting.level == logging.WARNING
    assert settings.admission.server is None


def test_cli_import_is_light_and_registers_operator() -> None:
    code = (
        "import sys, dwdp.cli; p = dwdp.cli.build_parser(); "
        "assert 'kopf' not in sys.modules and 'kubernetes' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith(('kopf', 'kubernetes'))); "
        "a = p.parse_args(['operator', '--webhook-listen', '127.0.0.1:9443']); "
        "print(a.command, a.webhook_listen)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["operator", "127.0.0.1:9443"]


def test_operator_has_no_peering_option_the_lease_is_its_only_ha() -> None:
    import dwdp.cli

    parser = dwdp.cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "--peering", "dwdp"])
    args = parser.parse_args(["operator", "--leader-elect"])
    assert args.leader_elect is True


def test_probe_reads_every_local_rank_of_the_rank_program(tmp_path: Path) -> None:
    # one HTTP port per local rank: port and port + 1; the rendezvous port is ephemeral,
    # hence never in that block
    port, rdv = free_port_block(2), free_port()
    env = {
        **os.environ,
        "DWDP_POD_IP": "127.0.0.1",
        "DWDP_PORT": str(port),
        "DWDP_RANK": "0",
        "DWDP_WORLD_SIZE": "2",
        "DWDP_LOCAL_WORLD_SIZE": "2",
        "DWDP_RENDEZVOUS": f"127.0.0.1:{rdv}",
        "DWDP_GROUP": "demo-g0",
        "DWDP_INCARNATION": "2",
        "DWDP_REVISION": "rev1",
        "DWDP_TERMINATION_LOG": str(tmp_path / "term"),
    }
    proc = subprocess.Popen([sys.executable, "-m", "dwdp_dev.operator.rankprog"], env=env)
    pod = ObservedPod(
        name="p",
        role=Role.CONTEXT,
        group_index=0,
        incarnation=2,
        pod_index=0,
        revision="rev1",
        phase="Running",
        scheduled=True,
        started=True,
        deleting=False,
        ip="127.0.0.1",
        gate=False,
        ready=False,
        ranks=2,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            got = asyncio.run(probe_ranks([pod], base_port=port))["p"]
            if all(r is not None and r.committed for r in got) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [r.rank for r in got] == [0, 1]
        assert {(r.phase, r.revision, r.incarnation) for r in got} == {("committed", "rev1", 2)}
        assert len({r.layout_digest for r in got}) == 1
    finally:
        proc.terminate()
        proc.wait(10)
    # Nobody listens any more: the reports read as None, not as an error.
    assert asyncio.run(probe_ranks([pod], base_port=port, timeout=0.5)) == {"p": (None, None)}


def test_rank_program_fails_at_a_named_phase_with_a_termination_line(tmp_path: Path) -> None:
    port, rdv = free_port(), free_port()
    env = {
        **os.environ,
        "DWDP_POD_IP": "127.0.0.1",
        "DWDP_PORT": str(port),
        "DWDP_WORLD_SIZE": "1",
        "DWDP_RENDEZVOUS": f"127.0.0.1:{rdv}",
        "DWDP_TERMINATION_LOG": str(tmp_path / "term"),
        "RANKPROG_FAIL_PHASE": "P3",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dwdp_dev.operator.rankprog"],
        env=env,
        timeout=30,
        capture_output=True,
    )
    assert proc.returncode == 1
    line = (tmp_path / "term").read_text().strip()
    assert line.startswith("P3: rank 0 of group incarnation 0 failed")


def test_only_running_ungated_pods_are_probed() -> None:
    def pod(name: str, **kw) -> ObservedPod:
        base = dict(
            name=name,
            role=Role.CONTEXT,
            group_index=0,
            incarnation=0,
            pod_index=0,
            revision="r",
            phase="Running",
            scheduled=True,
            started=True,
            deleting=False,
            ip="1.2.3.4",
            gate=False,
            ready=False,
            ranks=1,
        )
        base.update(kw)
        return ObservedPod(**base)

    pods = [
        pod("a"),
        pod("b", gate=True),
        pod("c", phase="Pending"),
        pod("d", ip=None),
        pod("e", deleting=True),
    ]
    assert [p.name for p in to_probe(pods)] == ["a"]
    assert to_probe([pod("v", vllm=True)]) == []  # a vLLM server answers no /dwdp/status
    assert RankReport(0, "disabled").committed
    assert c.GATE_CONDITION == "dwdp.io/group-ready"
