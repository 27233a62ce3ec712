"""Host memory a rank can count on (issue 59): a pod of 4 cpu-backend ranks (``dwdp launch``,
expert + dense DWDP, a tiny Qwen3-MoE checkpoint) under a steady load, in one of two settings:

- ``--hog-fraction F`` (default 0.5): beside a process that holds F of the host's memory
  (touched, resident), the ranks as context servers of a vLLM tier (``kvTransfer.vllm``) with
  default settings: every request is a prefill whose KV is staged for a vLLM decode server
  (none reads it: leases expire, a full staging buffer answers 503);
- ``--limit GIB``: the pod inside a new memory cgroup of that limit (what a container with
  ``resources.limits.memory`` gets), the ranks aggregated servers, default settings.

It prints each rank's KV pool and ledger, the pod's peak (its cgroup's, or the sum of its
processes' ``VmHWM`` beside the hog), the kernel's OOM kills during the run (``/proc/vmstat``
``oom_kill``) and whether every rank and the hog are still alive. Run as root::

    .venv/bin/python bench/host_memory.py --seconds 300 --hog-fraction 0.5
    .venv/bin/python bench/host_memory.py --seconds 300 --limit 4
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mp"))
sys.path.insert(0, str(REPO / "tests" / "support"))

from _pods import launched_pod  # noqa: E402

from dwdp_dev.worker.cgroups import MemoryCgroup, memory_cgroup  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

GIB = 2**30
WORLD = 4
HOG = """
import sys, time
n = int(sys.argv[1])
block = bytearray(n)
for i in range(0, n, 4096):
    block[i] = 1
print("held", flush=True)
time.sleep(10**6)
"""


def _oom_kills() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return -1


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemTotal")


def _hwm_sum(root_pid: int) -> int:
    """The sum of ``VmHWM`` over ``root_pid`` and its descendants (bytes)."""
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total


def _load(urls: list[str], seconds: float, staged: bool) -> collections.Counter[int]:
    """Requests from 8 clients for ``seconds``, prompts of 9 to 100 words (under 450
    tokens); returns the answers' status codes (the first of each error status printed)."""
    codes: collections.Counter[int] = collections.Counter()
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        i = k
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < end:
                body = {"model": "tiny-qwen", "prompt": f"{i} " + "lorem " * (8 + (i * 37) % 92),
                        "max_tokens": 1 if staged else 32, "ignore_eos": True}
                if staged:
                    body["kv_transfer_params"] = {"do_remote_decode": True}
                r = http.post(urls[i % len(urls)] + "/v1/completions", json=body)
                if r.status_code != 200 and r.status_code not in codes:
                    print(f"first {r.status_code}: {r.text[:300]}")
                codes[r.status_code] += 1
                i += 8

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    return codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--hog-fraction", type=float, default=0.5)
    ap.add_argument("--limit", type=float, default=None, help="GiB: run in a memory cgroup")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dwdp-host-memory-"))
    ckpt = make_checkpoint("qwen3_moe", root / "ck", num_experts=8, seed=5, hidden_size=64,
                           head_dim=32, moe_width=32)  # a head size vLLM's CPU layout stages
    launch: dict = {"model": {"path": str(ckpt), "servedName": "tiny-qwen"}, "handleType": "shm",
                    "transport": "tcpStore", "dwdp": {"dwdpSize": WORLD, "enableDense": True},
                    "gracefulShutdownTimeoutSeconds": 5}
    hog = None
    with contextlib.ExitStack() as stack:
        group = None
        if args.limit is None:
            launch |= {"role": "context", "kvTransfer": {"vllm": {}}}
            hog = stack.enter_context(_hog(int(args.hog_fraction * _mem_total())))
        else:
            group = stack.enter_context(memory_cgroup(int(args.limit * GIB), "dwdp-bench"))
            print(f"pod in cgroup {group.version} {group.path}, limit {args.limit:.2f} GiB")
        kills = _oom_kills()
        try:
            _run(stack.enter_context(launched_pod(root, launch, WORLD, cgroup=group)),
                 args.seconds, hog is not None, group)
        finally:
            print(f"OOM kills on the host during the run: {_oom_kills() - kills}")
            if hog is not None:
                print(f"hog alive: {hog.poll() is None}")
    return 0


@contextlib.contextmanager
def _hog(size: int) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``size`` bytes, resident, until the end."""
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(size)], stdout=subprocess.PIPE,
                           text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        print(f"hog holds {size / GIB:.2f} GiB of {_mem_total() / GIB:.2f}")
        yield hog
    finally:
        hog.kill()
        hog.wait()


def _run(pod: tuple[Any, list[str], str, Path], seconds: float, staged: bool,
         group: MemoryCgroup | None) -> None:
    """Print the ranks' pools and ledgers, load them for ``seconds``, print the outcome."""
    proc, urls, _g, _term = pod
    for url in urls:
        st = httpx.get(url + "/dwdp/status", timeout=10).json()
        pool, memory = st["kv_cache"], st["memory"]
        parts = {k: round((v["host"] or 0) / GIB, 3) for k, v in memory.items()}
        print(f"{url}: pool {pool['capacity_tokens']} tokens, {pool['bytes'] / GIB:.2f} GiB of "
              f"{pool['free_bytes'] / GIB:.2f} GiB free; ledger GiB {parts}")
    codes = _load(urls, seconds, staged=staged)
    alive = proc.poll() is None and all(
        httpx.get(u + "/ready", timeout=5).status_code == 200 for u in urls)
    peak = group.peak() if group else _hwm_sum(proc.pid)
    print(f"answers {dict(codes)} in {seconds:.0f} s; pod peak {peak / GIB:.2f} GiB"
          f"{' (cgroup)' if group else ' (sum of VmHWM)'}; every rank alive: {alive}"
          + (f"; cgroup working set now {group.working_set() / GIB:.2f} GiB, OOM kills "
             f"{group.oom_kills()}" if group else ""))
    for url in urls:  # the blocks the prefix cache keeps were all filled once
        st = httpx.get(url + "/dwdp/status", timeout=10).json()
        cached = st["prefix_cache"]["cached_blocks"] * 16
        print(f"{url}: {cached} of the pool's {st['kv_cache']['capacity_tokens']} tokens hold "
              "cached prefixes")


if __name__ == "__main__":
    raise SystemExit(main())
