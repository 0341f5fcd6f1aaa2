"""kvcomp over llama.cpp's RPC backend, on loopback (docs/distributed.md).

Two ggml-rpc-servers of this build (CPU backend, one thread each) hold the model's layers and
their KV cache; the client's logits are compared with a local run of the same configuration
(the same kernels run on the servers, so they agree to the rounding of a different thread
split). Upstream's own rpc-server (built from the sdist without the patches), and one of this
build that says what upstream's says, are refused with the type named before a kvc tensor is
sent to them, and hold the layers when the cache stays here (-nkvo); one killed or stopped during a request ends
that request with an HTTP error and leaves llama-server up; one that is not there fails --rpc by name. Every server
is started and stopped here, by PID.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ggml_kvcomp import calibrate, models, upstream
from ggml_kvcomp.kvtypes import KvConfig

from .server import free_port, get, post, server

# loopback KLD between a run over RPC and the same run here: the servers split attention over
# one thread instead of two, which reorders sums of floats and nothing else
KLD_BOUND = 1e-5


@dataclass
class RpcServers:
    endpoints: list[str]
    procs: list[subprocess.Popen[bytes]]

    @property
    def arg(self) -> str:
        return ",".join(self.endpoints)


@contextlib.contextmanager
def rpc_servers(bins: Path, n: int, log_dir: Path, env: dict[str, str] | None = None,
                binary: Path | None = None) -> Iterator[RpcServers]:
    """n ggml-rpc-servers (this build's, or `binary`) on free loopback ports."""
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: list[str] = []
    with contextlib.ExitStack() as stack:
        try:
            for i in range(n):
                port = free_port()
                log = stack.enter_context((log_dir / f"rpc-{i}.log").open("w"))
                args = [str(binary or bins / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
                procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                              env={**os.environ, **(env or {})}))
                endpoints.append(f"127.0.0.1:{port}")
            for ep, proc in zip(endpoints, procs, strict=True):
                host, port_s = ep.split(":")
                deadline = time.time() + 30
                while True:
                    assert proc.poll() is None, f"ggml-rpc-server {ep} exited during start-up"
                    with contextlib.suppress(OSError), socket.create_connection((host, int(port_s)), timeout=1):
                        break
                    assert time.time() < deadline, f"ggml-rpc-server {ep} did not listen"
                    time.sleep(0.2)
            # the probe connections above were served and closed; give each server time to go
            # back to accept(), which serves one client at a time
            time.sleep(0.5)
            yield RpcServers(endpoints, procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)


def _ppl(bins: Path, model: Path, text: Path, kv: list[str], *extra: str,
         timeout: int = 600) -> subprocess.CompletedProcess[str]:
    # --no-repack: a server's CPU backend holds the weights as they are, so the run here must
    # too (repacked Q4_K weights alone give Gemma a KLD of 0.006 against the unrepacked run)
    args = [str(bins / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "256", "-b", "256",
            "--chunks", "2", "-t", "2", "--no-warmup", "-fa", "on", "--no-repack", *kv, *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def _kld(log: str) -> float:
    m = re.search(r"^Mean\s+KLD:\s*([\d.eE+-]+)", log, re.MULTILINE)
    assert m, log[-3000:]
    return float(m.group(1))


@pytest.mark.parametrize(("model_name", "config"), [
    # every kvc type: kvc8 (high-precision), kvc4, kvc3 (balanced's V), kvc2, kvct4, kvct3, kvct5, kvc5
    *[("smollm2-135m", c) for c in ["f16", "kvc4", "low-latency", "balanced", "high-precision", "balanced:k1",
                                     "kvct3/kvc2", "kvct5/kvc5"]],
    # two caches (sliding window and full), a kvct4 K cache with its plans and positions, the buffer
    ("gemma3-270m", "balanced:k1"),
])
def test_perplexity_over_two_rpc_servers_matches_local(bins: Path, text: Path, tmp_path: Path, model_name: str,
                                                        config: str) -> None:
    model = models.fetch_model(model_name)
    kv = calibrate.kv_args(KvConfig.parse(config), model)
    base = tmp_path / "local.kld"
    local = _ppl(bins, model, text, kv, "--kl-divergence-base", str(base))
    assert local.returncode == 0, local.stderr[-3000:]
    with rpc_servers(bins, 2, tmp_path) as rpc:
        remote = _ppl(bins, model, text, kv, "--rpc", rpc.arg, "-ngl", "99", "-lv", "4", "--kl-divergence-base",
                      str(base), "--kl-divergence")
    log = remote.stdout + remote.stderr
    assert remote.returncode == 0, log[-3000:]
    # the layers and their caches are on the servers, none here
    assert set(re.findall(r"RPC\d\[(127\.0\.0\.1:\d+)\] KV buffer size", log)) == set(rpc.endpoints), log[-3000:]
    assert _kld(log) <= KLD_BOUND


@pytest.mark.parametrize("server_kind", ["upstream", "says-upstream"])
def test_server_without_the_kvc_types_is_refused_by_name(bins: Path, model: Path, text: Path, tmp_path: Path,
                                                         server_kind: str) -> None:
    # upstream's own rpc-server (built from the sdist without the patches), and one of this
    # build that says 0 in its HELLO as upstream's does
    binary = upstream.unpatched_rpc_server() if server_kind == "upstream" else None
    env = {"GGML_KVCOMP_RPC_CAPS": "0"} if server_kind == "says-upstream" else None
    with rpc_servers(bins, 1, tmp_path, env=env, binary=binary) as rpc:
        t0 = time.time()
        proc = _ppl(bins, model, text, ["-ctk", "kvc4", "-ctv", "kvc4"], "--rpc", rpc.arg, "-ngl", "99", timeout=120)
        log = proc.stdout + proc.stderr
        assert proc.returncode != 0 and proc.returncode > 0, log[-3000:]  # an error exit, not a signal
        assert "does not know the type kvc4" in log and "--no-kv-offload" in log, log[-3000:]
        assert time.time() - t0 < 120
        # the same server holds the layers when the KV cache stays here
        kept = _ppl(bins, model, text, ["-ctk", "kvc4", "-ctv", "kvc4"], "--rpc", rpc.arg, "-ngl", "99", "-nkvo")
        assert kept.returncode == 0, (kept.stdout + kept.stderr)[-3000:]


@pytest.mark.parametrize(("config", "refused"), [("balanced:k1", "kvct4"), ("kvc4/kvc5", "kvc5")])
def test_cpu_only_cache_on_a_server_without_cpu_kernels_is_refused(bins: Path, model: Path, text: Path,
                                                                   tmp_path: Path, config: str, refused: str) -> None:
    """A server that knows every type but whose devices are not the CPU backend (what one with
    a GPU says) cannot read kvct or kvc5 rows yet: refused with the reason, and -nkvo runs."""
    kv = calibrate.kv_args(KvConfig.parse(config), model)
    with rpc_servers(bins, 1, tmp_path, env={"GGML_KVCOMP_RPC_CAPS": "0x7f"}) as rpc:
        proc = _ppl(bins, model, text, kv, "--rpc", rpc.arg, "-ngl", "99", timeout=120)
        log = proc.stdout + proc.stderr
        assert proc.returncode > 0, log[-3000:]
        assert f"{refused} caches run on the CPU backend for now" in log, log[-3000:]
        kept = _ppl(bins, model, text, kv, "--rpc", rpc.arg, "-ngl", "99", "-nkvo")
        assert kept.returncode == 0, (kept.stdout + kept.stderr)[-3000:]


@pytest.mark.parametrize("config", ["balanced", "balanced:k1"])
def test_llama_server_balanced_over_rpc(bins: Path, model: Path, tmp_path: Path, config: str) -> None:
    # a time limit the client cannot read is named in the log, and the default used
    env = {"GGML_KVCOMP_RPC_TIMEOUT": "soon"}
    kv = calibrate.kv_args(KvConfig.parse(config), model)
    with rpc_servers(bins, 2, tmp_path) as rpc, \
            server(bins, model, "-c", "1024", "-np", "1", "-fa", "on", *kv, "--metrics", "--rpc", rpc.arg, "-ngl", "99",
                   "--slot-save-path", str(tmp_path), log=tmp_path / "server.log", env=env) as url:
        request = {"prompt": "Write a short note about the number 7 and why it is interesting:", "n_predict": 24,
                   "temperature": 0, "cache_prompt": False}
        body = post(f"{url}/completion", request)
        assert body["tokens_predicted"] == 24 and body["content"]
        status, metrics = get(f"{url}/metrics")
        assert status == 200 and "kvcomp_" in metrics
        saved = post(f"{url}/slots/0?action=save", {"filename": "slot0.bin"})
        first = (tmp_path / "slot0.bin").read_bytes()
        restored = post(f"{url}/slots/0?action=restore", {"filename": "slot0.bin"})
        assert restored["n_restored"] == saved["n_saved"]
        post(f"{url}/slots/0?action=save", {"filename": "slot0-again.bin"})
        assert (tmp_path / "slot0-again.bin").read_bytes() == first
    log = (tmp_path / "server.log").read_text()
    assert "GGML_KVCOMP_RPC_TIMEOUT=soon is not a number of seconds" in log


# how long a stopped server is waited for in the tests (GGML_KVCOMP_RPC_TIMEOUT)
STOPPED_TIMEOUT_S = 5


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_rpc_server_lost_during_a_request_is_an_error(bins: Path, model: Path, tmp_path: Path, how: str) -> None:
    """An rpc-server killed during generation (its connection closes), or stopped (SIGSTOP:
    the connection stays open and nothing answers): the request ends with an HTTP error in
    bounded time, llama-server stays up and answers every later request with an error (the
    lost host is not reconnected, docs/distributed.md "Failures")."""
    env = {"GGML_KVCOMP_RPC_TIMEOUT": str(STOPPED_TIMEOUT_S)}
    with rpc_servers(bins, 2, tmp_path) as rpc, \
            server(bins, model, "-c", "1024", "-np", "1", "-fa", "on", "--kv-comp", "balanced", "--rpc", rpc.arg,
                   "-ngl", "99", log=tmp_path / "server.log", env=env) as url:
        # (no end of text before the loss: the request must still be running)
        request = {"prompt": "Count from one to one thousand, in words:", "n_predict": 600, "temperature": 0,
                   "ignore_eos": True, "cache_prompt": False}
        assert post(f"{url}/completion", {**request, "n_predict": 4})["tokens_predicted"] == 4
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, f"{url}/completion", request)
            time.sleep(1.0)
            t0 = time.time()
            rpc.procs[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            with pytest.raises(urllib.error.HTTPError) as err:
                pending.result(timeout=120)
            elapsed = time.time() - t0
            assert elapsed < 120
        if how == "stopped":
            assert elapsed >= STOPPED_TIMEOUT_S - 1  # it was the limit that ended the wait
        assert err.value.code == 500 and "Compute error" in err.value.read().decode()
        assert get(f"{url}/health")[0] == 200
        with pytest.raises(urllib.error.HTTPError) as again:
            post(f"{url}/completion", {**request, "n_predict": 4})
        assert again.value.code == 500
    # the mode's kvct K cannot live on an RPC host: it kept kvc4 K rather than refuse to start
    log = (tmp_path / "server.log").read_text()
    assert "the K cache is on a device without kvct kernels: --kv-comp balanced stores K as kvc4" in log
    log = (tmp_path / "server.log").read_text()
    assert f"RPC server {rpc.endpoints[1]}: the connection is lost" in log


def test_unreachable_rpc_server_is_an_error(bins: Path, model: Path, text: Path) -> None:
    """A server that is not there when the client starts: an error exit that names it, not an
    abort."""
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = _ppl(bins, model, text, ["-ctk", "kvc4", "-ctv", "kvc4"], "--rpc", endpoint, "-ngl", "99", timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode > 0, log[-3000:]
    # (the log's own line may not be written before the exit: the error says it all)
    assert f"cannot reach the RPC server {endpoint}: nothing listens there" in log, log[-3000:]
