"""dtype auto is chosen for the machine at load: bfloat16 on CUDA and on CPUs with native bf16 instructions, float32
on the others (where a bf16 prefill measured ~5x slower), and the choice is visible in Info and /metrics."""
from __future__ import annotations

import asyncio
import logging

import torch

from evospec import loading
from evospec.loading import cpu_description, resolve_dtype


def flags(monkeypatch, *names: str) -> None:
    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset({"sse2", "avx2", *names}))


def test_auto_is_bf16_only_where_the_cpu_has_it_natively(monkeypatch, caplog):
    cpu = torch.device("cpu")
    flags(monkeypatch)
    assert resolve_dtype("auto", cpu) == torch.float32
    with caplog.at_level(logging.WARNING, logger="evospec.loading"):
        assert resolve_dtype("bfloat16", cpu) == torch.bfloat16  # asked for: kept, with a warning that says why not
    assert "without native bf16" in caplog.text
    for native in ("avx512_bf16", "amx_bf16", "bf16"):
        flags(monkeypatch, native)
        assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32


def test_the_choice_is_in_info_and_metrics(tiny_draft_replica):
    from evospec.config import SchedulerConfig
    from evospec.services.common.metrics import HttpMetrics
    from evospec.services.config import TargetServiceConfig
    from evospec.services.target.grpc_api import info_to_proto
    from evospec.services.target.server import DraftSide, TargetServer
    from evospec.testing import prometheus_values
    _, _, pool = tiny_draft_replica

    async def name():
        return "tiny"
    server = TargetServer.from_config(TargetServiceConfig(scheduler=SchedulerConfig(adaptive=False)),
                                      DraftSide(pool, name, name))
    try:
        info = info_to_proto(asyncio.run(server.info()))
        assert info.target_dtype == "float32"  # the embedded tiny pair stays at the reference numerics under auto
        assert info.target_weights == "none"  # and dense (model.quantize auto)
        assert info.cpu == cpu_description() and torch.backends.cpu.get_cpu_capability() in info.cpu
        text = asyncio.run(HttpMetrics("tiny").render(server.replica)).decode()
        values = prometheus_values(text)
        assert any(k.startswith("evospec:engine_info") and f"dtype={info.target_dtype}" in k
                   and "weights=none" in k and v == 1
                   for k, v in values.items()), text
    finally:
        server.close()
