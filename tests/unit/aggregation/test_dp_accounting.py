"""The DP accountants against published values and against dp-accounting called directly (issue 28)."""

from __future__ import annotations

import dp_accounting
import pytest

from fedgrid.aggregation.accounting import Accountant, epsilon_of

# Opacus' own test values: q = 0.04, sigma = 1.5, 2,250 steps, delta = 1e-5.
Q, SIGMA, STEPS, DELTA = 0.04, 1.5, 2250, 1e-5


def _direct(accountant, q: float, sigma: float, steps: int) -> float:
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def test_rdp_gives_the_published_value_and_pld_is_no_larger():
    rdp = epsilon_of("rdp", ((Q, SIGMA, STEPS),), DELTA)
    pld = epsilon_of("pld", ((Q, SIGMA, STEPS),), DELTA)
    assert rdp == pytest.approx(7.33, abs=0.01)
    assert 6.5 < pld <= rdp  # PLD is tighter (about 6.77; PRV's estimate is about 6.78)


def test_the_accountants_agree_with_dp_accounting_called_directly():
    assert epsilon_of("rdp", ((Q, SIGMA, STEPS),), DELTA) == _direct(
        dp_accounting.rdp.RdpAccountant(), Q, SIGMA, STEPS
    )
    assert epsilon_of("pld", ((Q, SIGMA, STEPS),), DELTA) == _direct(
        dp_accounting.pld.PLDAccountant(), Q, SIGMA, STEPS
    )


def test_rounds_are_kept_as_groups_and_each_round_is_composed_at_its_rate():
    acc = Accountant("rdp", DELTA)
    for q in (0.1, 0.1, 0.1, 0.05):
        acc.spend(q, 1.0)
    assert acc.groups == [(0.1, 1.0, 3), (0.05, 1.0, 1)] and acc.rounds == 4
    direct = dp_accounting.rdp.RdpAccountant()
    for q in (0.1, 0.1, 0.1, 0.05):
        direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)))
    assert acc.epsilon() == pytest.approx(direct.get_epsilon(DELTA), rel=1e-12)
    # A round nobody took part in spends nothing; a larger rate spends more.
    assert acc.epsilon_after(0.0, 1.0) == acc.epsilon()
    assert acc.epsilon() < acc.epsilon_after(0.05, 1.0) < acc.epsilon_after(0.2, 1.0)


def test_the_state_restores_the_spent_budget_bit_for_bit():
    acc = Accountant("pld", DELTA)
    for q in (0.2, 0.2, 0.1):
        acc.spend(q, 2.0)
    again = Accountant("pld", DELTA)
    again.load_state_dict(acc.state_dict())
    assert again.epsilon() == acc.epsilon() > 0 and again.rounds == 3
    with pytest.raises(ValueError, match="accounted by 'pld' with delta 1e-05, this run asks for 'rdp'"):
        Accountant("rdp", DELTA).load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="q in \\[0, 1\\]"):
        again.load_state_dict({**acc.state_dict(), "groups": [[1.5, 2.0, 1]]})


def test_bad_accountant_arguments_are_named():
    with pytest.raises(ValueError, match="unknown accountant 'prv'"):
        Accountant("prv", DELTA)
    with pytest.raises(ValueError, match="delta must be in"):
        Accountant("rdp", 0.0)
