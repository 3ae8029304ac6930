"""The SDK as its own distribution: `pip install ./client` into a fresh venv (no torch, no Ray) gives a working sync
and async client against the running service."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
# The server's tested pins (pyproject.toml); the client itself accepts any grpcio/protobuf its generated code runs on.
PINS = ["grpcio==1.85.1", "protobuf==7.36.2"]

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from evospec_client import AsyncEvoSpecClient, EvoSpecClient, InvalidArgument
    address = sys.argv[1]
    out = {}
    with EvoSpecClient(address, timeout=120) as c:
        out["info"] = c.info()
        deltas = list(c.stream(prompt_token_ids=[9707, 11, 1879], max_tokens=12, method="evospec", ignore_eos=True))
        out["sync_ids"] = [t for d in deltas for t in d.token_ids]
        out["sync_stats"] = deltas[-1].stats
        out["once_ids"] = c.generate_once(prompt_token_ids=[9707, 11, 1879], max_tokens=12, method="ar",
                                          ignore_eos=True).token_ids
        try:
            c.generate(prompt="hi", max_tokens=0)
        except InvalidArgument as e:
            out["error"] = e.details
    async def run():
        async with AsyncEvoSpecClient(address, timeout=120) as c:
            got = [d async for d in c.stream(prompt_token_ids=[9707, 11, 1879], max_tokens=12, method="frspec",
                                             ignore_eos=True)]
            return [t for d in got for t in d.token_ids]
    out["async_ids"] = asyncio.run(run())
    out["modules"] = sorted({m.split(".")[0] for m in sys.modules})
    print(json.dumps(out))
""")


def test_sdk_from_a_fresh_venv(service, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    source = shutil.copytree(ROOT / "client", tmp_path / "client",  # the build writes build/ beside its sources
                             ignore=shutil.ignore_patterns("build", "*.egg-info"))
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(source), *PINS],
                             capture_output=True, text=True, timeout=480)
    assert install.returncode == 0, install.stderr[-2000:]
    installed = json.loads(subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True,
                                          text=True, check=True).stdout)
    names = {p["name"].lower() for p in installed}
    assert "evospec-client" in names and not names & {"torch", "ray", "transformers", "evospec-serve"}

    run = subprocess.run([str(python), "-c", SCRIPT, service[0]], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # not the repository root: only the installed package is importable
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["info"]["methods"] == ["ar", "sd", "frspec", "evospec", "lookup"]
    assert len(out["sync_ids"]) == 12 and out["sync_stats"]["method"] == "evospec"
    assert out["sync_ids"] == out["once_ids"] == out["async_ids"]  # greedy: every method gives the target's tokens
    assert "max_tokens" in out["error"]
    assert not {"torch", "ray", "evospec"} & set(out["modules"])
