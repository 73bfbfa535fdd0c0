"""Error feedback under partial participation: the momentum variant, the staleness rule, its config keys."""

from __future__ import annotations

import math

import pytest
import torch

from fedgrid.client.uplink import UplinkEncoder, feedback_rule
from fedgrid.compression import ErrorFeedback
from fedgrid.compression.feedback import FeedbackRule
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.config_compression import feedback_task_config
from fedgrid.errors import ConfigError


def _participation(steps: int, clients: int, share: float, seed: int) -> torch.Tensor:
    """(steps, clients) booleans: who takes part in each round (``share`` of them, at least one)."""
    gen = torch.Generator().manual_seed(seed)
    taking = torch.rand(steps, clients, generator=gen) < share
    taking[taking.sum(dim=1) == 0, 0] = True
    return taking


@pytest.mark.parametrize("spec", ["classic", "momentum:0.9"])
def test_residual_stays_bounded_over_1000_rounds_at_10_percent_participation(spec: str) -> None:
    """topk:0.1 contracts by d = 0.1 on every input, so ||e|| <= sqrt(1 - d) M / (1 - beta sqrt(1 - d))
    for inputs of norm at most M, whatever the rounds a client sat out (the decay only shrinks e)."""
    rule = FeedbackRule.parse(spec)
    clients, steps = 10, 1000
    feedback = [ErrorFeedback(CodecSpec.parse("topk:0.1"), rule) for _ in range(clients)]
    taking = _participation(steps, clients, 0.1, seed=3)
    gen = torch.Generator().manual_seed(4)
    drift = torch.randn(clients, 400, generator=gen)  # each client's persistent direction (non-IID)
    c = math.sqrt(1 - 0.1)
    bound = c / (1 - rule.beta * c)
    largest, worst, stale = 0.0, 0.0, 0
    for t in range(steps):
        for i in torch.nonzero(taking[t]).flatten().tolist():
            ef = feedback[i]
            if ef.last_round is not None and t - ef.last_round > 1:
                stale += 1
            ef.begin_round(t)
            x = drift[i] + 0.5 * torch.randn(400, generator=gen)
            largest = max(largest, float(x.norm()))
            ef.encode("w", x)
            norm = float(ef.residuals["w"].norm())
            worst = max(worst, norm / largest)
            assert norm <= bound * largest * (1 + 1e-5), f"round {t} client {i}: {norm} > {bound * largest}"
    assert stale > 50  # most uploads come after rounds sat out
    assert worst > 0.5  # the bound is met with the residual doing real work
    if rule.beta < 1:
        assert worst <= c / (1 - 0.9 * c) + 1e-6 < math.sqrt(0.9) / (1 - math.sqrt(0.9))


def test_stale_residual_decays_per_round_sat_out_and_resets() -> None:
    ef = ErrorFeedback(CodecSpec.parse("topk:0.1"), FeedbackRule.parse("momentum:0.5", reset_rounds=4))
    ef.begin_round(1)
    ef.encode("w", torch.arange(1.0, 101.0))
    kept = ef.residuals["w"].clone()
    assert float(kept.norm()) > 0
    assert ef.begin_round(4) == 0.25  # sat out rounds 2 and 3
    assert torch.equal(ef.residuals["w"], kept * 0.25)
    ef.encode("w", torch.zeros(100))
    assert ef.begin_round(9) == 0.0 and not ef.residuals  # sat out 5..8: 4 rounds, the reset rule
    classic = ErrorFeedback(CodecSpec.parse("topk:0.1"))
    classic.begin_round(1)
    classic.encode("w", torch.arange(1.0, 101.0))
    before = classic.residuals["w"].clone()
    assert classic.begin_round(50) == 1.0 and torch.equal(classic.residuals["w"], before)


def test_momentum_feedback_decays_the_residual_inside_each_step() -> None:
    x1, x2 = torch.arange(1.0, 101.0), torch.linspace(-1, 1, 100)
    ef = ErrorFeedback(CodecSpec.parse("topk:0.1"), FeedbackRule(beta=0.9))
    ef.encode("w", x1)
    e1 = ef.residuals["w"].clone()
    sent = ef.encode("w", x2)
    v = 0.9 * e1 + x2
    assert torch.equal(sent.decoded, ef.codec.decode(ef.codec.encode(v), dtype=v.dtype, shape=(100,)))
    torch.testing.assert_close(ef.residuals["w"], v - sent.decoded)


@pytest.mark.parametrize("spec", ["int8", "topk:0.1", "powersgd:2", "randk:0.2"])
def test_a_round_encoded_again_sends_the_same_bytes_and_leaves_the_same_residual(spec: str) -> None:
    """A task handed again after a restart (the first upload never counted) encodes from what
    its round began from, in memory and after a save and load: same payloads, one step of
    residual; a later round goes on from it as if the round had run once."""
    gen = torch.Generator().manual_seed(5)
    updates = [torch.randn(20, 30, generator=gen) for _ in range(4)]

    def encode(ef: ErrorFeedback, server_round: int) -> bytes:
        ef.begin_round(server_round)
        generator = torch.Generator().manual_seed(server_round)  # the uplink's: one seed a round
        return ef.encode("w", updates[server_round - 1], generator=generator).payload

    once = ErrorFeedback(CodecSpec.parse(spec))
    sent = [encode(once, r) for r in (1, 2, 3)]
    twice = ErrorFeedback(CodecSpec.parse(spec))
    assert [encode(twice, 1), encode(twice, 2)] == sent[:2]
    assert encode(twice, 2) == sent[1]  # round 2 again, in memory
    restarted = ErrorFeedback(CodecSpec.parse(spec))
    restarted.load_state_dict(twice.state_dict())
    assert encode(restarted, 2) == sent[1]  # and after a restart from its saved state
    assert encode(restarted, 3) == sent[2]
    assert torch.equal(restarted.residuals["w"], once.residuals["w"])
    once.begin_round(4)
    restarted.begin_round(4), restarted.begin_round(4)  # begun twice, not encoded: as once
    assert torch.equal(restarted.residuals["w"], once.residuals["w"])
    simulated = ErrorFeedback(CodecSpec.parse(spec), repeatable=False)  # never handed a round twice
    assert [encode(simulated, r) for r in (1, 2, 3)] == sent and simulated.state_dict()["round_start"] is None


def test_state_dict_keeps_the_last_round() -> None:
    ef = ErrorFeedback(CodecSpec.parse("int8"), FeedbackRule(beta=0.5))
    ef.begin_round(7)
    ef.encode("w", torch.randn(300))
    again = ErrorFeedback(CodecSpec.parse("int8"), FeedbackRule(beta=0.5))
    again.load_state_dict(ef.state_dict())
    assert again.last_round == 7 and again.begin_round(9) == 0.5


@pytest.mark.parametrize(
    "overrides,key,match",
    [
        (
            {"error_feedback": "momentum:1.5"},
            "error_feedback",
            r"'auto', 'classic', 'momentum:BETA' with BETA in \(0, 1\), or 'none'.*'momentum:1.5'",
        ),
        ({"error_feedback": "ef21"}, "error_feedback", r"got 'ef21'"),
        ({"error_feedback": "momentum:0"}, "error_feedback", r"BETA in \(0, 1\)"),
        ({"feedback_reset_rounds": -1}, "feedback_reset_rounds", r"at least 0, got -1"),
    ],
)
def test_bad_feedback_keys_are_named(overrides: dict, key: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load_config(overrides={"codec": "topk:0.1", **overrides})
    assert info.value.key == key


def test_the_rule_travels_in_the_task_config() -> None:
    config = load_config(
        overrides={"codec": "sparseloco", "error_feedback": "momentum:0.95", "feedback_reset_rounds": 3}
    )
    assert config.error_feedback == "momentum:0.95" and config.feedback_reset_rounds == 3
    task = feedback_task_config(config.error_feedback, config.feedback_reset_rounds)
    assert task == {"uplink_feedback": "momentum:0.95", "uplink_feedback_reset": 3}
    assert feedback_rule(task) == FeedbackRule(0.95, 3)
    assert feedback_task_config("auto", 0) == {} and feedback_rule({}) == FeedbackRule(kind="auto")
    assert feedback_task_config("classic", 0) == {"uplink_feedback": "classic"}
    uplink = UplinkEncoder(CodecSpec.parse("sparseloco")).begin(5, task)
    assert uplink.feedback is not None and uplink.feedback.rule == FeedbackRule(0.95, 3)
    assert uplink.feedback.last_round == 5
    with pytest.raises(ConfigError, match="error_feedback"):
        feedback_rule({"uplink_feedback": "momentum:x"})
    assert feedback_rule({"uplink_feedback_reset": 3.0}) == FeedbackRule(1.0, 3, "auto")  # a wire's float
    with pytest.raises(ConfigError, match="feedback_reset_rounds"):
        feedback_rule({"uplink_feedback_reset": "3"})


def test_auto_runs_unbiased_codecs_without_a_residual_and_the_others_with_classic_ef() -> None:
    """``auto`` (the default): ``randk:F:unbiased`` sends C(x) each round and keeps nothing;
    ``topk`` keeps a residual that decays by half per step; the others classic EF's; ``none``
    keeps none for any codec."""
    assert load_config(overrides={}).error_feedback == "auto"
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    unbiased = UplinkEncoder(CodecSpec.parse("randk:0.1:unbiased")).begin(1, {})
    assert unbiased.feedback is not None and unbiased.feedback.rule.kind == "none"
    sent = unbiased.feedback.encode("w", x, generator=torch.Generator().manual_seed(2))
    assert not unbiased.feedback.residuals and int((sent.decoded != 0).sum()) == 100
    torch.testing.assert_close(sent.decoded[sent.decoded != 0], 10 * x[sent.decoded != 0])
    topk = UplinkEncoder(CodecSpec.parse("topk")).begin(1, {})
    assert topk.feedback is not None and topk.feedback.rule == FeedbackRule(0.5, 0)
    sent = topk.feedback.encode("w", x)
    torch.testing.assert_close(topk.feedback.residuals["w"], x - sent.decoded)
    again = topk.feedback.encode("w", x)  # v = x + 0.5 e
    torch.testing.assert_close(topk.feedback.residuals["w"], x + 0.5 * (x - sent.decoded) - again.decoded)
    int8 = UplinkEncoder(CodecSpec.parse("int8+zstd")).begin(1, {"uplink_feedback_reset": 4})
    assert int8.feedback is not None and int8.feedback.rule == FeedbackRule(1.0, 4)
    assert UplinkEncoder(CodecSpec.parse("topk+zstd")).begin(1, {}).feedback.rule.spec == "momentum:0.5"  # type: ignore[union-attr]
    plain = ErrorFeedback(CodecSpec.parse("topk:0.1"), FeedbackRule.parse("none"))
    plain.encode("w", x)
    assert not plain.residuals and plain.rule.spec == "none"


def test_an_unbiased_codec_under_a_residual_rule_is_refused_naming_the_key() -> None:
    """Scaled rand-k is not contractive: under classic EF its residual would grow without bound."""
    with pytest.raises(
        ConfigError, match=r"config key 'codec': codec 'randk:0.25:unbiased' is not contractive"
    ):
        load_config(overrides={"codec": "randk", "error_feedback": "classic"})
    with pytest.raises(ConfigError, match=r"'randk:0.25:unbiased' is not contractive"):
        UplinkEncoder(CodecSpec.parse("randk")).begin(1, {"uplink_feedback": "momentum:0.9"})
    assert load_config(overrides={"codec": "randk", "error_feedback": "none"}).codec == "randk"
    with pytest.raises(ConfigError, match=r"config key 'error_feedback': expected 'auto', 'classic'"):
        load_config(overrides={"error_feedback": "ef22"})


def test_sparseloco_auto_residual_stays_bounded_over_1000_rounds_at_10_percent_participation() -> None:
    """``sparseloco`` under its ``auto`` rule (``momentum:0.95``): every encode contracts its input
    ``v`` by at least ``d`` (measured: ``||v - D(C(v))||^2 <= (1 - d) ||v||^2``), so the residual
    stays under ``sqrt(1 - d) M / (1 - 0.95 sqrt(1 - d))`` for inputs of norm at most ``M``."""
    rule = FeedbackRule.parse("auto")
    clients, steps, n = 10, 1000, 600  # one short chunk: min(64, 600) kept
    feedback = [ErrorFeedback(CodecSpec.parse("sparseloco"), rule) for _ in range(clients)]
    assert feedback[0].rule.spec == "momentum:0.95"
    taking = _participation(steps, clients, 0.1, seed=5)
    gen = torch.Generator().manual_seed(6)
    drift = torch.randn(clients, n, generator=gen)
    largest, worst, least_d = 0.0, 0.0, 1.0
    for t in range(steps):
        for i in torch.nonzero(taking[t]).flatten().tolist():
            ef = feedback[i]
            ef.begin_round(t)
            before = ef.residuals.get("w")
            x = drift[i] + 0.5 * torch.randn(n, generator=gen)
            v = x + (0.95 * before if before is not None else 0.0)
            largest = max(largest, float(x.norm()))
            sent = ef.encode("w", x).decoded
            assert int((sent != 0).sum()) == 64
            least_d = min(least_d, 1 - float((v - sent).square().sum() / v.square().sum()))
            worst = max(worst, float(ef.residuals["w"].norm()) / largest)
    c = math.sqrt(1 - least_d)
    assert least_d > 0.03  # contractive on every input
    assert 0.5 < worst <= c / (1 - 0.95 * c), (worst, least_d)
