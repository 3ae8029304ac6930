"""Speculative statistics are defined once: the engine's accumulator has exactly the public proto's fields."""
from evospec.engine.stats import SpecStats
from evospec.services.target.grpc_api import stats_to_proto
from evospec_client.api.v1 import generate_pb2 as pb

SERVICE_FIELDS = {"ttft_seconds", "e2e_seconds", "method"}  # added by the target server per request


def test_engine_stats_and_proto_have_the_same_fields():
    proto_fields = {f.name for f in pb.SpecStats.DESCRIPTOR.fields if not f.name.endswith("_name")}  # enums' strings
    assert set(SpecStats().as_dict()) == proto_fields - SERVICE_FIELDS


def test_every_statistic_reaches_the_proto():
    stats = SpecStats(prompt_tokens=3, generated_tokens=9, draft_seconds=0.5, verify_seconds=0.25,
                      draft_head_seconds=0.125, misses=2, verified_positions=8, buffer_updates=4,
                      buffer_update_seconds=0.0625)
    stats.record_step(drafted=4, accepted=3)
    stats.record_step(drafted=4, accepted=1)
    msg = stats_to_proto({**stats.as_dict(), "ttft_seconds": 0.5, "e2e_seconds": 1.0, "method": "evospec"})
    assert list(msg.accepted_per_pos) == [2, 1, 1]
    assert (msg.steps, msg.drafted, msg.accepted, msg.misses, msg.verified_positions) == (2, 8, 4, 2, 8)
    assert msg.tau == 3.0 and msg.alpha == 0.5 and msg.miss_rate == 0.25
    assert (msg.draft_head_seconds, msg.buffer_update_seconds) == (0.125, 0.0625)
    assert (msg.method, msg.method_name) == (pb.METHOD_EVOSPEC, "evospec")  # the enum and its string form
