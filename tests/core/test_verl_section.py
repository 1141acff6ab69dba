"""The verl plugin's ``emapg:`` section is validated the way the sweep spec is: a pydantic model whose errors carry
the field path, rendered in one line by experiments.errors. The core's own dataclasses (KL, anchor, loss) keep their
checks and refuse a key they do not have. Pure Python: no verl."""

import pytest
from pydantic import ValidationError

from ema_pg_core.config import AnchorConfig, KLConfig
from experiments.backends.verl.config import EmaPGSection, split_argv
from experiments.errors import classify, validation_line


@pytest.mark.parametrize(
    "section,loc,line",
    [
        ({"bogus": 1}, ("bogus",), "unknown key bogus; allowed: kl, anchor, loss, metrics_path, mask_truncated"),
        ({"kl": {"kk": 1}}, ("kl", "kk"), "unknown key kl.kk (did you mean kl.k?); allowed: type, k, tail, coef"),
        ({"device": "tpu"}, ("device",), "device='tpu' is not allowed; allowed values: cuda, cpu"),
        ({"probe_every": -1}, ("probe_every",), "probe_every must be an integer >= 0; got -1"),
        ({"probe_size": 0}, ("probe_size",), "probe_size must be an integer >= 1; got 0"),
        ({"probe_every": "2"}, ("probe_every",), "probe_every must be an integer >= 0; got '2'"),
        ({"mask_truncated": "yes"}, ("mask_truncated",), "mask_truncated must be true or false; got str: 'yes'"),
        ({"anchor": {"tau": 1.5}}, ("anchor",), "anchor: algo.anchor.tau must be in [0, 1]; got 1.5"),
        ({"kl": {"type": "nope"}}, ("kl",), "kl: algo.kl.type='nope' is not allowed; allowed values: exact_forward"),
        ({"kl": {"type": "full_reverse"}}, (), "algo.kl.type='full_reverse' needs full (B, T, V) anchor logits"),
    ],
)
def test_a_bad_section_is_refused_naming_the_field(section, loc, line):
    with pytest.raises(ValidationError) as err:
        EmaPGSection.model_validate(section)
    assert err.value.errors()[0]["loc"] == loc
    assert classify(err.value)[1] == 2  # the one error path: a one-line message, exit 2
    message = validation_line(err.value, EmaPGSection.model_json_schema(), root="emapg")
    assert "\n" not in message and message.startswith(line), message


def test_the_section_round_trips_and_holds_the_core_dataclasses():
    section = EmaPGSection(kl=KLConfig(type="topk_forward", k=8), anchor=AnchorConfig(tau=0.95), probe_every=5)
    assert isinstance(section.kl, KLConfig) and isinstance(section.anchor, AnchorConfig)
    assert EmaPGSection.model_validate(section.model_dump()) == section
    assert section.model_dump()["kl"]["k"] == 8
    _, parsed = split_argv(
        ["emapg.kl.type=topk_forward", "emapg.kl.k=8", "emapg.anchor.tau=0.95", "emapg.probe_every=5"]
    )
    assert parsed == section
    with pytest.raises(ValidationError):  # an assignment is validated too
        section.probe_size = 0
    assert EmaPGSection(runner_env={"WANDB_RUN_ID": 123}).runner_env == {"WANDB_RUN_ID": "123"}
