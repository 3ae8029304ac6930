"""The Serve-CLI path of docs/deploy.md, run the way a user runs it on a CPU-only machine:

    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=... ray start --head --num-gpus=2 --node-ip-address=127.0.0.1
    RAY_ADDRESS=127.0.0.1:PORT RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=... serve run orchestration/configs/serve-cpu.yaml

on a cluster of its own (private temp dir, free ports; the YAML is copied with free HTTP/gRPC ports instead of
8000/9000). Teardown stops only the processes this test started: SIGINT to `serve run` (deletes the app), SIGTERM to
`ray start --block` (stops the cluster it started); never `ray stop`.
"""
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from evospec.config import SamplingParams, SpecParams
from evospec.orchestration.config import CONFIG_DIR
from evospec.orchestration.local import free_port
from evospec.tokenizer import chat_prompt_ids

pytestmark = [pytest.mark.e2e, pytest.mark.nightly, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MESSAGES = [{"role": "user", "content": "Does regular exercise lower blood pressure?"}]


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not seen in {path.name}:\n{path.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen, sig: int, timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own process group only
            proc.wait(10)


@pytest.fixture(scope="module")
def cli_service():
    tmp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's unix socket paths must stay < 107 bytes
    # Token authentication on both sides with a token of this cluster's own (RAY_AUTH_TOKEN_PATH): neither side
    # creates one, and relying on ~/.ray/auth_token made this pass only where an earlier run had left one.
    token_path = tmp / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token_path)}
    gcs_port = free_port()
    head_log = tmp / "head.log"
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--num-gpus=2", "--num-cpus=4", "--node-ip-address=127.0.0.1",
         f"--port={gcs_port}", f"--temp-dir={tmp / 'ray'}", "--include-dashboard=false", "--disable-usage-stats",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         f"--object-store-memory={256 * 1024**2}"],
        env=env, stdout=head_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    serve_proc = None
    try:
        wait_for_text(head_log, "block forever", head, timeout_s=120)
        config = yaml.safe_load((CONFIG_DIR / "serve-cpu.yaml").read_text())
        grpc_port = free_port()
        config["http_options"]["port"] = free_port()
        config["grpc_options"]["port"] = grpc_port
        config_path = tmp / "serve-cpu.yaml"
        config_path.write_text(yaml.safe_dump(config))
        serve_log = tmp / "serve.log"
        serve_proc = subprocess.Popen([str(BIN / "serve"), "run", str(config_path)], cwd=ROOT,
                                      env={**env, "RAY_ADDRESS": f"127.0.0.1:{gcs_port}"},
                                      stdout=serve_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        from evospec_client import EvoSpecClient
        with EvoSpecClient(f"127.0.0.1:{grpc_port}", timeout=120) as client:
            try:
                client.wait_ready(timeout=300)
            except Exception as exc:
                log = serve_log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"service not ready ({exc!r}):\n{log}") from None
            yield client
    finally:
        if serve_proc is not None:
            stop(serve_proc, signal.SIGINT)
        stop(head, signal.SIGTERM)
        shutil.rmtree(tmp, ignore_errors=True)


def test_serve_cli_deployment_streams_the_target_greedy_answer(cli_service, in_process):
    prompt = chat_prompt_ids(in_process.tokenizer, MESSAGES)
    gen = in_process.decoder.generate(prompt, SamplingParams(max_tokens=32), SpecParams(method="ar"))
    list(gen)
    deltas = list(cli_service.stream(messages=MESSAGES, max_tokens=32, temperature=0.0))  # default method: evospec
    assert [t for d in deltas for t in d.token_ids] == gen.output_ids
    assert deltas[-1].finish_reason in ("stop", "length")
    assert deltas[-1].stats["method"] == "evospec" and deltas[-1].stats["steps"] > 0
