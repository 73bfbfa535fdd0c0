"""Unit tests of model partitions: ``blocks``, the ``bcd`` strategy and streaming DiLoCo."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
import torch

from fedgrid.aggregation import (
    BlockCoordinate,
    DiLoCo,
    Krum,
    Median,
    StreamingDiLoCo,
    blocks_from_prefixes,
    default_blocks,
    matches_prefix,
)
from fedgrid.aggregation.blocks import balanced_split
from fedgrid.aggregation.selection import Sampling
from fedgrid.errors import ConfigError
from fedgrid.types import ClientInfo, Failure, FitRes, TensorSpec

from aggsim import clients, fake_fit, model_state, run_round

SPECS = TensorSpec.of(model_state())
NAMES = list(SPECS)


def _assert_partition(blocks, names=NAMES):
    flat = [n for b in blocks for n in b.names]
    assert flat == names  # every tensor exactly once, contiguous, in model order
    assert [b.index for b in blocks] == list(range(len(blocks)))
    for b in blocks:
        assert b.names and b.numel == sum(torch.Size(SPECS[n].shape).numel() for n in b.names)
        assert [n for n in names if any(matches_prefix(n, p) for p in b.prefixes)] == list(b.names)


# -- partitions ----------------------------------------------------------------------------
def test_matches_prefix_respects_module_boundaries():
    assert matches_prefix("layer1.weight", "layer1") and matches_prefix("layer1.weight", "layer1.")
    assert matches_prefix("fc.bias", "fc.bias")
    assert not matches_prefix("layer10.weight", "layer1")


def test_balanced_split_hand_computed():
    assert balanced_split([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7]  # sums 15, 13, 17 (optimal max 17)
    assert balanced_split([1] * 10, 3) == [0, 4, 8]
    assert balanced_split([100, 1, 1], 3) == [0, 1, 2]
    assert balanced_split([5, 5], 1) == [0]
    with pytest.raises(ValueError):
        balanced_split([1, 2], 3)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 6])
def test_default_blocks_partition_the_model(count):
    blocks = default_blocks(SPECS, count)
    assert len(blocks) == count
    _assert_partition(blocks)


def test_default_blocks_group_top_level_modules_balanced():
    # enc: 12 + 4 = 16 elements, bn: 4 + 1 = 5, head: 8 + 2 = 10
    assert [b.prefixes for b in default_blocks(SPECS, 2)] == [("enc",), ("bn", "head")]
    assert [b.prefixes for b in default_blocks(SPECS, 3)] == [("enc",), ("bn",), ("head",)]
    # more blocks than top-level modules: one level deeper (single tensors here)
    assert [len(b.names) for b in default_blocks(SPECS, 6)] == [1] * 6
    with pytest.raises(ValueError, match="6 tensors into 7 blocks"):
        default_blocks(SPECS, 7)


def test_blocks_from_prefixes():
    blocks = blocks_from_prefixes(SPECS, [["enc", "head"], ["bn"]])
    assert blocks[0].names == ("enc.weight", "enc.bias", "head.weight", "head.bias")
    assert blocks[1].names == ("bn.running_mean", "bn.num_batches_tracked")
    with pytest.raises(ValueError, match="match no block prefix"):
        blocks_from_prefixes(SPECS, [["enc"], ["bn"]])
    with pytest.raises(ValueError, match="matches blocks 0 and 1"):
        blocks_from_prefixes(SPECS, [["enc", "bn", "head"], ["enc.bias"]])
    with pytest.raises(ValueError, match="matches no tensor"):
        blocks_from_prefixes(SPECS, [["enc", "bn", "head"], ["decoder"]])


# -- bcd -----------------------------------------------------------------------------------
def _bcd(**kwargs) -> BlockCoordinate:
    strategy = BlockCoordinate(**kwargs)
    strategy.initialize(initial_state=model_state())
    return strategy


@pytest.mark.parametrize("schedule", ["cyclic", "random", "capacity"])
def test_bcd_tasks_expect_exactly_their_block(schedule):
    strategy = _bcd(num_blocks=3, block_schedule=schedule, sampling=Sampling(fit_config={"lr": 0.1}))
    _assert_partition(strategy.blocks)
    live = clients(7, memory=[5, 1, 7, 3, 2, 6, 4])
    for server_round in (1, 2, 3):
        pairs = strategy.configure_round(server_round=server_round, clients=live)
        assert [c for c, _ in pairs] == live
        for _, ins in pairs:
            block = strategy.blocks[ins.config["block"]]
            assert ins.expected == OrderedDict((n, SPECS[n]) for n in block.names)
            prefixes = str(ins.config["block_prefixes"]).split(",")
            assert [n for n in NAMES if any(matches_prefix(n, p) for p in prefixes)] == list(block.names)
            assert (
                ins.config["algorithm"] == "bcd" and ins.config["num_blocks"] == 3 and ins.config["lr"] == 0.1
            )
        counts = Counter(ins.config["block"] for _, ins in pairs)
        assert set(counts) == {0, 1, 2} and min(counts.values()) >= 7 // 3  # k >= B: every block trained


def test_bcd_per_round_schedule_is_the_default_and_gives_every_client_the_same_block():
    strategy = _bcd(num_blocks=3)
    assert strategy.schedule == "per-round"
    live = clients(5)
    assert [strategy.assign_blocks(server_round=r, clients=live) for r in (1, 2, 3, 4)] == [
        [0] * 5,
        [1] * 5,
        [2] * 5,
        [0] * 5,
    ]
    pairs = strategy.configure_round(server_round=2, clients=live)
    assert {ins.config["block"] for _, ins in pairs} == {1} and len(
        {id(ins) for _, ins in pairs}
    ) == 1  # one shared task
    assert strategy.min_clients_per_block(5) == 5
    strategy = _bcd(num_blocks=2, aggregator=Krum(f=1))  # every client on the one block: Krum sees all 5
    strategy.check_preconditions(num_clients=5)
    with pytest.raises(ConfigError, match="krum"):
        strategy.check_preconditions(num_clients=4)


def test_bcd_cyclic_schedule_rotates():
    strategy = _bcd(num_blocks=3, block_schedule="cyclic")
    live = clients(3)
    rounds = [strategy.assign_blocks(server_round=r, clients=live) for r in (1, 2, 3)]
    assert rounds == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]  # each client visits every block
    few = clients(2)
    windows = [strategy.assign_blocks(server_round=r, clients=few) for r in (1, 2, 3)]
    assert windows == [[0, 1], [2, 0], [1, 2]]  # k < B: consecutive windows cover every block


def test_bcd_random_schedule_is_seeded():
    live = clients(4)
    a = [
        _bcd(num_blocks=4, block_schedule="random", sampling=Sampling(seed=5)).assign_blocks(
            server_round=r, clients=live
        )
        for r in range(1, 9)
    ]
    b = [
        _bcd(num_blocks=4, block_schedule="random", sampling=Sampling(seed=5)).assign_blocks(
            server_round=r, clients=live
        )
        for r in range(1, 9)
    ]
    c = [
        _bcd(num_blocks=4, block_schedule="random", sampling=Sampling(seed=6)).assign_blocks(
            server_round=r, clients=live
        )
        for r in range(1, 9)
    ]
    assert a == b and a != c
    assert all(sorted(x) == [0, 1, 2, 3] for x in a)  # a permutation each round
    assert len({tuple(x) for x in a}) > 1


def test_bcd_capacity_gives_larger_blocks_to_larger_memory():
    strategy = _bcd(num_blocks=3, block_schedule="capacity")  # sizes: enc 16, bn 5, head 10
    live = clients(3, memory=[300, 100, 200])
    assert strategy.assign_blocks(server_round=1, clients=live) == [0, 1, 2]  # most memory -> enc
    live6 = clients(6, memory=[6, 1, 5, 2, 4, 3])
    got = strategy.assign_blocks(server_round=1, clients=live6)
    sizes = [strategy.blocks[b].numel for b in got]
    by_memory = sorted(range(6), key=lambda i: live6[i].memory_bytes)
    assert [sizes[i] for i in by_memory] == sorted(sizes) and set(got) == {0, 1, 2}
    # k < B: the round's window of blocks, the largest of it to the most memory
    two = clients(2, memory=[10, 20])
    first = strategy.assign_blocks(server_round=1, clients=two)
    second = strategy.assign_blocks(server_round=2, clients=two)
    assert first == [1, 0] and set(first) | set(second) == {0, 1, 2}


def test_bcd_averages_each_block_over_its_clients():
    strategy = _bcd(num_blocks=3, block_schedule="cyclic")
    init = model_state()
    live = clients(5)  # round 1, cyclic: blocks 0, 1, 2, 0, 1
    pairs = strategy.configure_round(server_round=1, clients=live)
    sent = strategy.downlink_state(server_round=1)
    results = [fake_fit(c, ins, sent) for c, ins in pairs]
    results = [r for r in results if r.client.name != "c02"]  # block 2's only client failed
    metrics = strategy.aggregate(server_round=1, results=results, failures=[])
    assert metrics["blocks_updated"] == 2.0
    new = strategy.global_state
    for index in (0, 1):
        trained = [r for r in results if set(r.state) == set(strategy.blocks[index].names)]
        assert len(trained) == 2
        total = sum(r.num_examples for r in trained)
        for name in strategy.blocks[index].names:
            mean = sum(r.state[name].double() * r.num_examples for r in trained) / total
            if init[name].dtype.is_floating_point:
                torch.testing.assert_close(new[name], mean.to(init[name].dtype))
            else:
                assert new[name].item() == round(float(mean))
            assert not torch.equal(new[name], init[name])
    for name in strategy.blocks[2].names:
        assert torch.equal(new[name], init[name])  # nobody trained it: unchanged


def test_bcd_rejects_result_of_no_block():
    strategy = _bcd(num_blocks=2)
    bad = FitRes(ClientInfo("x", "x"), OrderedDict([("enc.weight", torch.zeros(4, 3))]), num_examples=1)
    with pytest.raises(ValueError, match="form no block"):
        strategy.aggregate(server_round=1, results=[bad], failures=[])


def test_bcd_robust_aggregator_per_block():
    strategy = _bcd(num_blocks=2, aggregator=Median(), block_schedule="cyclic")
    run_round(strategy, 1, clients(6))
    strategy = _bcd(num_blocks=2, aggregator=Krum(f=0), block_schedule="cyclic")  # needs 3 per block
    metrics = run_round(strategy, 1, clients(5))  # blocks get 3 and 2 clients
    assert metrics["blocks_updated"] == 1.0 and metrics["blocks_skipped"] == 1.0
    strategy.check_preconditions(num_clients=6)
    with pytest.raises(ConfigError, match="needs more than 2f"):
        strategy.check_preconditions(num_clients=5)


def test_bcd_arguments():
    with pytest.raises(ValueError, match="block_schedule"):
        BlockCoordinate(block_schedule="greedy")
    with pytest.raises(ValueError, match="num_blocks=3 but 2 blocks"):
        BlockCoordinate(num_blocks=3, block_prefixes=[["enc"], ["bn", "head"]])
    strategy = _bcd(block_prefixes=[["enc"], ["bn", "head"]])
    assert strategy.num_blocks == 2 and strategy.blocks[1].names[0] == "bn.running_mean"
    with pytest.raises(ConfigError, match="match no block prefix") as info:
        _bcd(block_prefixes=[["enc"], ["bn"]])
    assert info.value.key == "block_prefixes"
    with pytest.raises(ConfigError, match="into 9 blocks") as info:
        _bcd(num_blocks=9)
    assert info.value.key == "num_blocks"


def test_bcd_upload_is_a_fraction_of_the_model():
    strategy = _bcd(num_blocks=3)
    total = sum(torch.Size(s.shape).numel() for s in SPECS.values())
    for _, ins in strategy.configure_round(server_round=1, clients=clients(3)):
        assert ins.expected is not None
        assert sum(torch.Size(s.shape).numel() for s in ins.expected.values()) <= 16 < total


# -- streaming DiLoCo ----------------------------------------------------------------------
def test_streaming_fragments_partition_and_rotate():
    strategy = StreamingDiLoCo(num_fragments=3, inner_steps=10)
    strategy.initialize(initial_state=model_state())
    _assert_partition(strategy.fragments)
    live = clients(2)
    for server_round in range(1, 7):
        fragment = strategy.fragments[server_round % 3]
        for _, ins in strategy.configure_round(server_round=server_round, clients=live):
            assert ins.expected == OrderedDict((n, SPECS[n]) for n in fragment.names)
            assert ins.config["fragment"] == server_round % 3
            assert ins.config["merge_fragment"] == (server_round - 1) % 3
            assert ins.config["num_fragments"] == 3 and ins.config["inner_steps"] == 10
            assert ins.config["algorithm"] == "streaming-diloco"
            assert ins.config["fragment_prefixes"] == ",".join(fragment.prefixes)
            # Round 1: nobody has a record, so everyone takes the whole model; then the fragment synced last round.
            merged = strategy.fragments if server_round == 1 else [strategy.fragments[(server_round - 1) % 3]]
            assert ins.config["merge_fragment_prefixes"] == ",".join(p for f in merged for p in f.prefixes)
            assert ins.download == (
                None if server_round == 1 else strategy.fragments[(server_round - 1) % 3].names
            )
        before = OrderedDict((k, v.clone()) for k, v in strategy.global_state.items())
        metrics = run_round(strategy, server_round, live)
        assert metrics["fragment"] == float(fragment.index)
        for name, t in strategy.global_state.items():
            assert torch.equal(t, before[name]) != (name in fragment.names), name  # only the fragment moves
    momentum = strategy.server_optimizer.state_dict()["buffers"]["momentum"]
    assert set(momentum) == {n for n in NAMES if SPECS[n].dtype.is_floating_point}


def test_streaming_with_one_fragment_is_diloco():
    streaming, plain = StreamingDiLoCo(num_fragments=1), DiLoCo()
    for s in (streaming, plain):
        s.initialize(initial_state=model_state())
    for server_round in (1, 2, 3):
        run_round(streaming, server_round, clients(3))
        run_round(plain, server_round, clients(3))
    for name, t in plain.global_state.items():
        assert torch.equal(streaming.global_state[name], t)


def test_streaming_outer_momentum_is_per_fragment():
    strategy = StreamingDiLoCo(num_fragments=2)
    strategy.initialize(initial_state=model_state())
    run_round(strategy, 1, clients(2))  # fragment 1
    buffers = strategy.server_optimizer.state_dict()["buffers"]["momentum"]
    assert set(buffers) == {n for n in strategy.fragments[1].names if SPECS[n].dtype.is_floating_point}


def test_streaming_too_many_fragments():
    # Row slices of the tensors above a fair share make 17 units of the 6 tensors: 20 is too many.
    with pytest.raises(ConfigError, match="17 units into 20 blocks") as info:
        StreamingDiLoCo(num_fragments=20).initialize(initial_state=model_state())
    assert info.value.key == "num_fragments"
    with pytest.raises(ValueError, match="num_fragments"):
        StreamingDiLoCo(num_fragments=0)


def _names(strategy: StreamingDiLoCo, *indices: int) -> tuple[str, ...]:
    return tuple(n for f in strategy.fragments if f.index in indices for n in f.names)


def test_streaming_downloads_the_fragments_synced_since_each_clients_last_round():
    """F = 3. c00 takes part in every round; c01 misses round 3; c02 fails round 2; c03 is
    away for rounds 2 to 4 (F rounds); c04 joins in round 4."""
    strategy = StreamingDiLoCo(num_fragments=3)
    strategy.initialize(initial_state=model_state())
    c = clients(5)
    live = {1: c[:4], 2: c[:4], 3: [c[0], c[2]], 4: c[:3] + [c[4]], 5: c}
    tasks = {}
    for server_round in range(1, 6):
        pairs = strategy.configure_round(server_round=server_round, clients=live[server_round])
        tasks[server_round] = {client.name: ins for client, ins in pairs}
        sent = strategy.downlink_state(server_round=server_round)
        results = [
            fake_fit(client, ins, sent)
            for client, ins in pairs
            if not (client.name == "c02" and server_round == 2)
        ]
        failures = [
            Failure(client, "ValueError: no replica")
            for client, _ in pairs
            if client.name == "c02" and server_round == 2
        ]
        strategy.aggregate(server_round=server_round, results=results, failures=failures)

    def download(server_round, name):
        return tasks[server_round][name].download

    assert all(ins.download is None for ins in tasks[1].values())  # nobody has a record yet
    assert download(2, "c00") == _names(strategy, 1)  # round 1 synced fragment 1
    assert download(3, "c00") == _names(strategy, 2) and download(4, "c00") == _names(strategy, 0)
    assert download(4, "c01") == _names(strategy, 0, 2)  # missed round 3: fragments 2 and 0, in model order
    merge = tasks[4]["c01"].config["merge_fragment_prefixes"]
    assert merge == ",".join(p for f in strategy.fragments if f.index in (0, 2) for p in f.prefixes)
    assert download(3, "c02") is None and download(4, "c02") == _names(
        strategy, 0
    )  # failed: whole model once
    assert download(4, "c04") is None  # new
    assert download(5, "c03") is None  # away for F rounds: every fragment changed
    whole = ",".join(p for f in strategy.fragments for p in f.prefixes)
    assert tasks[5]["c03"].config["merge_fragment_prefixes"] == whole
    for name in ("c00", "c01", "c02", "c04"):
        assert download(5, name) == _names(strategy, 1)
        assert tasks[5][name].config["merge_fragment_prefixes"] == ",".join(strategy.fragments[1].prefixes)
    # Every task of a round expects the same upload and carries the same config besides the merge.
    for pairs in tasks.values():
        assert len({tuple(ins.expected) for ins in pairs.values()}) == 1
    assert strategy.state_dict()["last_round"] == {f"id-{i}": 5 for i in range(5)}


def test_streaming_forgets_clients_away_for_f_rounds():
    strategy = StreamingDiLoCo(num_fragments=2)
    strategy.initialize(initial_state=model_state())
    c = clients(2)
    run_round(strategy, 1, c)
    assert strategy.state_dict()["last_round"] == {"id-0": 1, "id-1": 1}
    run_round(strategy, 2, c[:1])
    assert strategy.state_dict()["last_round"] == {"id-0": 2}  # id-1 needs the whole model in round 3 anyway
    pairs = strategy.configure_round(server_round=3, clients=c)
    assert [ins.download for _, ins in pairs] == [_names(strategy, 0), None]


def test_streaming_checkpoint_keeps_the_records_and_refuses_bad_ones():
    strategy = StreamingDiLoCo(num_fragments=3)
    strategy.initialize(initial_state=model_state())
    run_round(strategy, 1, clients(3))
    run_round(strategy, 2, clients(2))
    state = strategy.state_dict()
    assert state["last_round"] == {"id-0": 2, "id-1": 2, "id-2": 1}
    resumed = StreamingDiLoCo(num_fragments=3)
    resumed.load_state_dict(state)
    assert resumed.configure_round(server_round=3, clients=clients(3)) == strategy.configure_round(
        server_round=3, clients=clients(3)
    )
    with pytest.raises(ValueError, match="last_round"):
        resumed.load_state_dict({**state, "last_round": {"id-0": "soon"}})
    assert resumed.state_dict()["last_round"] == state["last_round"]  # unchanged by the refused load
    older = {k: v for k, v in state.items() if k != "last_round"}  # a checkpoint from before the records
    resumed.load_state_dict(older)
    assert all(ins.download is None for _, ins in resumed.configure_round(server_round=3, clients=clients(3)))


def test_a_late_fragment_merges_into_its_own_fragment_discounted_for_its_staleness():
    """F = 3, outer lr 1 without momentum (the step is the aggregate itself). Round 1 (fragment 1)
    closes at its quorum with c00's result; c01's lands late and merges into round 2 (which syncs
    fragment 2) through the quorum's merge (``late_to_merge``): fragment 2 moves by c00's
    difference, fragment 1 by c01's difference from round 1's model times (1 + 1) ** -0.5,
    fragment 0 not at all. Round 3's downloads take fragments 1 and 2, the two round 2 changed."""
    from fedgrid.events import EventLog
    from fedgrid.fleet.base import LateResult, Quorum, RoundOutcome
    from fedgrid.server.late_merge import late_to_merge

    strategy = StreamingDiLoCo(num_fragments=3, outer_lr=1.0, outer_momentum=0.0)
    strategy.initialize(initial_state=model_state())
    c0, c1 = clients(2)
    tasks1 = dict(strategy.configure_round(server_round=1, clients=[c0, c1]))
    sent1 = strategy.downlink_state(server_round=1)
    strategy.aggregate(server_round=1, results=[fake_fit(c0, tasks1[c0], sent1)], failures=[])
    late = fake_fit(c1, tasks1[c1], sent1)  # trained from round 1's model, fragment 1

    before = OrderedDict((k, v.clone()) for k, v in strategy.global_state.items())
    ((_, ins2),) = strategy.configure_round(server_round=2, clients=[c0])  # c01 is still on its task
    sent2 = strategy.downlink_state(server_round=2)
    fresh = fake_fit(c0, ins2, sent2)
    quorum = Quorum(min_quorum=1, grace_s=0.0, max_staleness=5, staleness_exponent=0.5)
    outcome = RoundOutcome([fresh], [], late=[LateResult(late, 1, sent1)])
    merged = late_to_merge(quorum, 2, outcome, EventLog())
    assert [(r.task_round, r.delta, r.weight) for r in merged] == [(1, True, c1.num_examples * 2**-0.5)]
    metrics = strategy.aggregate(server_round=2, results=[fresh, *merged], failures=[])

    assert metrics["fragment"] == 2.0 and metrics["late_fragments"] == 1.0
    fragments = strategy.fragments
    for name, now in strategy.global_state.items():
        old = before[name]
        if name in fragments[2].names and now.is_floating_point():  # the round's own: c00's difference
            torch.testing.assert_close(now, old + (fresh.state[name] - sent2[name]), rtol=0, atol=1e-6)
        elif name in fragments[1].names and now.is_floating_point():  # the late one's, discounted
            expected = old + 2**-0.5 * (late.state[name] - sent1[name])
            torch.testing.assert_close(now, expected, rtol=0, atol=1e-6)
            assert not torch.equal(now, old)
        elif name in fragments[0].names:
            assert torch.equal(now, old), name  # nobody synced it
        else:  # an integer buffer takes its results' value
            source = fresh if name in fragments[2].names else late
            assert torch.equal(now, source.state[name]), name
    tasks3 = dict(strategy.configure_round(server_round=3, clients=[c0, c1]))
    for client in (c0, c1):  # both take fragments 1 and 2: round 2 changed both
        assert tasks3[client].download == _names(strategy, 1, 2)
    restored = StreamingDiLoCo(num_fragments=3, outer_lr=1.0, outer_momentum=0.0)
    restored.load_state_dict(strategy.state_dict())  # a restart keeps what round 2 changed
    assert dict(restored.configure_round(server_round=3, clients=[c0]))[c0].download == _names(strategy, 1, 2)
