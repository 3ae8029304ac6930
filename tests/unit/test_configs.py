"""Every YAML under orchestration/configs/ loads and validates; defaults live once, in the core types."""
from pathlib import Path

import pytest
import yaml

from evospec.config import METHODS, SamplingParams, SpecParams
from evospec.orchestration.app import GRPC_SERVICER_FUNCTIONS
from evospec.orchestration.cli import DEMO_SAMPLING, build_parser
from evospec.orchestration.config import CONFIG_DIR, AppConfig
from evospec.services.config import DraftServiceConfig, TargetServiceConfig

YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))
SERVE_YAMLS = [p for p in YAMLS if "applications" in yaml.safe_load(p.read_text())]
APP_YAMLS = [p for p in YAMLS if p not in SERVE_YAMLS]


def test_there_are_both_kinds():
    assert {p.name for p in APP_YAMLS} >= {"cpu-tiny.yaml", "gpu-qwen3.yaml"}
    assert {p.name for p in SERVE_YAMLS} >= {"serve-cpu.yaml", "serve-gpu.yaml"}


@pytest.mark.parametrize("path", APP_YAMLS, ids=lambda p: p.name)
def test_app_yaml_validates(path: Path):
    cfg = AppConfig.from_yaml(path)
    assert cfg.target.default_spec.method in METHODS
    # each deployment's part is complete on its own (what build_app ships to each replica)
    assert DraftServiceConfig(**cfg.draft.model_dump(mode="json")) == cfg.draft
    assert TargetServiceConfig(**cfg.target.model_dump(mode="json")) == cfg.target


@pytest.mark.parametrize("path", SERVE_YAMLS, ids=lambda p: p.name)
def test_serve_yaml_validates(path: Path):
    from ray.serve.schema import ServeDeploySchema
    schema = ServeDeploySchema(**yaml.safe_load(path.read_text()))
    assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICER_FUNCTIONS
    for function in schema.grpc_options.grpc_servicer_functions:  # Serve imports these in its proxy
        module, name = function.rsplit(".", 1)
        assert callable(getattr(__import__(module, fromlist=[name]), name))
    for app in schema.applications:
        module, name = app.import_path.split(":")
        assert callable(getattr(__import__(module, fromlist=[name]), name))
        AppConfig.from_yaml(app.args["config"])


def test_unknown_and_mismatched_fields_are_refused():
    with pytest.raises(ValueError, match="extra"):
        AppConfig(draft={"num_gpus": 1})  # replica options live under draft.replica
    with pytest.raises(ValueError, match="same artifact"):
        AppConfig(draft={"static_vocab": "a.json"}, target={"static_vocab": "b.json"})


def test_cli_defaults_are_the_core_defaults():
    """Sampling flags default to the demo's sampling; speculation flags to unset (the service's default_spec), which
    in process means the core defaults; every typed field and option has its flag."""
    from evospec.config import SPEC_OPTIONS
    from evospec.orchestration.cli import request_from_args
    args = build_parser().parse_args(["demo"])
    spec = SpecParams()
    assert all(getattr(args, option) is None for option in SPEC_OPTIONS)
    sampling, in_process = request_from_args(args)
    assert in_process == spec and sampling == DEMO_SAMPLING
    args = build_parser().parse_args(["demo", "--tree", "tree", "--depth", "3", "--retrieval", "target",
                                      "--no-predraft", "--seed", "7"])
    sampling, chosen = request_from_args(args)
    assert (chosen.tree.shape, chosen.tree.depth, chosen.vocab.retrieval, chosen.predraft) == ("tree", 3,
                                                                                               ("target",), False)
    assert sampling.seed == 7
    assert TargetServiceConfig().default_spec == spec
    assert SamplingParams().greedy  # requests without sampling fields are greedy
