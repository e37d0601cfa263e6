"""The averaging backends over a real 2-rank group, checked against float64 hand computations.

One spawn of 2 ranks (CPU over gloo; with 2 GPUs, also one GPU each over nccl) runs every scenario in
tests/helpers/collective_ranks.py in sequence, for both DeviceAverager (whole and in pipelined chunks) and
HostAverager, and saves each rank's values around one round (`begin` → `finish` → `adopt`). The tests
recompute the weighted consensus, the float32 buffer mean, the divergence, the EASGD blend, the
bf16 wire and the outer optimizers by hand from those recorded values.
"""

from __future__ import annotations

import pytest
import torch

from flodl.averaging.outer import OuterSettings
from flodl.averaging.wire import BLOCK, WIRES, QuantizedWire
from tests.helpers.collective_ranks import SCENARIOS, TRAIN_DURING_ROUND, VIEW_STEPS, WORLD, worker
from tests.helpers.spawned import run_ranks

pytestmark = pytest.mark.multiproc

REL = 1e-6
F32_BUFFERS = ("1.running_mean", "1.running_var")
COUNTER = "1.num_batches_tracked"
BACKENDS = ("device", "chunked", "host")


@pytest.fixture(
    scope="module",
    params=[
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA devices"),
            ],
        ),
    ],
)
def ranks(request, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp(f"consensus-{request.param}")
    run_ranks(worker, WORLD, out_dir, request.param)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


# --- hand computations (float64, independent of flodl.averaging.weights) -------------------------


def hand_weights(steps: tuple[int, ...], gamma: float) -> list[float]:
    """n_k^gamma / Σ n^gamma, with idle ranks (n = 0) weighing exactly 0."""
    masses = [float(n) ** gamma if n > 0 else 0.0 for n in steps]
    return [m / sum(masses) for m in masses]


def weighted(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    return sum(w * t.double() for w, t in zip(weights, tensors, strict=True))


def rounds(ranks: list[dict], name: str, i: int = 0) -> list[dict]:
    """Round `i` of scenario `name`, one record per rank."""
    return [r[name]["rounds"][i] for r in ranks]


def consensus(ranks: list[dict], name: str, i: int = 0) -> dict[str, torch.Tensor]:
    spec = SCENARIOS[name]
    weights = hand_weights(spec.steps, spec.gamma)
    recs = rounds(ranks, name, i)
    return {
        p: weighted([r["before"]["params"][p] for r in recs], weights) for p in recs[0]["before"]["params"]
    }


def buffer_mean(ranks: list[dict], name: str, i: int = 0) -> dict[str, torch.Tensor]:
    movers = [n > 0 for n in SCENARIOS[name].steps]
    weights = [m / sum(movers) for m in movers]
    recs = rounds(ranks, name, i)
    return {b: weighted([r["before"]["buffers"][b] for r in recs], weights) for b in F32_BUFFERS}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


def assert_rel(actual: dict, expected: dict, rel: float = REL) -> None:
    assert actual.keys() >= expected.keys()
    for k, want in expected.items():
        assert actual[k].dtype == torch.float32, k
        err = rel_err(actual[k], want)
        assert err <= rel, f"{k}: relative error {err:.3g} > {rel}"


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def f32(buffers: dict) -> dict:
    return {b: buffers[b] for b in F32_BUFFERS}


def hand_divergence(pre: dict, post: dict) -> float:
    p = torch.cat([pre[k].double().reshape(-1) for k in pre])
    q = torch.cat([post[k].double().reshape(-1) for k in pre])
    return float((p - q).norm() / q.norm())


def numel(tensors: dict) -> int:
    return sum(t.numel() for t in tensors.values())


def names(*short: str, backends=BACKENDS) -> list[str]:
    return [f"{b}/{s}" for b in backends for s in short]


AVG = ("work_weighted", "plain_mean", "inverse_work", "steep_gamma")
IDLE = ("idle_rank1_gamma1", "idle_rank1_gamma0", "idle_rank1_gamma-1", "idle_rank0_gamma0")
ALL_IDLE = ("all_idle_gamma1", "all_idle_gamma0")

# --- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_starts_from_rank0(ranks, name):
    a, b = (r[name]["initial"] for r in ranks)
    for k in a["params"]:
        assert not torch.equal(a["params"][k], b["params"][k]), k  # else the broadcast proves nothing
    for r, rank in enumerate(ranks):
        got = rank[name]["constructed"]
        assert_bitwise(got["params"], a["params"])
        assert_bitwise(f32(got["buffers"]), f32(a["buffers"]))
        assert int(got["buffers"][COUNTER]) == 3 + r  # integer buffers stay local


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ranks_enter_the_round_with_different_states(ranks, name):
    """Guards the other tests: a consensus of identical replicas would prove nothing."""
    a, b = (rec["before"] for rec in rounds(ranks, name))
    for group in ("params", "buffers"):
        for k in a[group]:
            assert not torch.equal(a[group][k], b[group][k]), (name, k)


# --- the weighted consensus ----------------------------------------------------------------------


@pytest.mark.parametrize("name", names(*AVG))
def test_params_adopt_the_gamma_weighted_consensus(ranks, name):
    want = consensus(ranks, name)
    for rec in rounds(ranks, name):
        assert_rel(rec["adopted"]["params"], want)
    a, b = (rec["adopted"]["params"] for rec in rounds(ranks, name))
    assert_bitwise(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gamma_changes_the_weights(ranks, backend):
    """(3,1) at gamma=1 is 3:1; the same states at gamma=0 would be 1:1 and at gamma=-1 1:3."""
    name = f"{backend}/work_weighted"
    got = rounds(ranks, name)[0]["adopted"]["params"]
    recs = rounds(ranks, name)
    for gamma in (0.0, -1.0):
        weights = hand_weights((3, 1), gamma)
        wrong = {k: weighted([r["before"]["params"][k] for r in recs], weights) for k in got}
        assert any(rel_err(got[k], wrong[k]) > 1e-3 for k in wrong), gamma
    assert hand_weights((4, 1), -1.0) == pytest.approx([0.2, 0.8], rel=1e-15)


@pytest.mark.parametrize("name", names(*AVG, "easgd", "bf16_wire", "slowmo", "diloco"))
def test_float32_buffers_are_the_plain_mean_over_movers(ranks, name):
    want = buffer_mean(ranks, name)
    for rec in rounds(ranks, name):
        assert_rel(rec["adopted"]["buffers"], want)


@pytest.mark.parametrize("name", [*SCENARIOS, "views"])
def test_integer_counter_stays_each_ranks_own(ranks, name):
    for r, rank in enumerate(ranks):
        recs = rank[name]["rounds"] if name != "views" else [{"adopted": rank[name]["adopted"]}]
        for i, rec in enumerate(recs):
            got = rec["adopted"]["buffers"][COUNTER]
            assert got.dtype == torch.int64
            want = 7 + 10 * r + i if name != "views" else 3 + r + 1  # views: one BN forward
            assert int(got) == want


@pytest.mark.parametrize("name", names(*AVG, "idle_rank1_gamma0", "easgd"))
def test_outcome_totals_payload_and_divergence(ranks, name):
    spec = SCENARIOS[name]
    want = consensus(ranks, name)
    for r, rec in enumerate(rounds(ranks, name)):
        out = rec["outcome"]
        assert out["steps"] == spec.steps[r]
        assert out["total_steps"] == sum(spec.steps)
        assert out["skipped"] is False
        params, buffers = rec["before"]["params"], f32(rec["before"]["buffers"])
        assert out["payload_bytes"] == 4 * (numel(params) + numel(buffers))
        assert out["divergence"] == pytest.approx(hand_divergence(params, want), rel=REL)
    # Each rank measures its own distance to the common consensus: with two ranks, |own - avg| is
    # w_other |θ_0 - θ_1|, so the divergences differ unless the weights are equal (plain mean).
    a, b = (rec["outcome"]["divergence"] for rec in rounds(ranks, name))
    weights = hand_weights(spec.steps, spec.gamma)
    assert a / b == pytest.approx(weights[1] / weights[0], rel=1e-5)


@pytest.mark.parametrize("name", ["device/replayed", "device/replayed_lean"])
def test_every_replayed_round_takes_that_rounds_weights(ranks, name):
    # Over nccl, rounds past the first CAPTURE_AFTER are one CUDA graph launch: the steps, the weights
    # and the totals must still be each round's own (rank 1 trains 2 more steps every round).
    spec = SCENARIOS[name]
    for i in range(spec.rounds):
        recs = rounds(ranks, name, i)
        steps = tuple(spec.steps_in(r, i) for r in range(WORLD))
        weights = hand_weights(steps, spec.gamma)
        want = {
            p: weighted([r["before"]["params"][p] for r in recs], weights)
            for p in recs[0]["before"]["params"]
        }
        movers = {b: weighted([r["before"]["buffers"][b] for r in recs], [0.5, 0.5]) for b in F32_BUFFERS}
        for rec in recs:
            assert_rel(rec["adopted"]["params"], want)
            assert_rel(rec["adopted"]["buffers"], movers)
            assert rec["outcome"]["total_steps"] == sum(steps), i
            if spec.keeps_own:
                assert rec["outcome"]["divergence"] == pytest.approx(
                    hand_divergence(rec["before"]["params"], want), rel=REL
                )
            else:
                assert rec["outcome"]["divergence"] == 0.0


def test_a_replayed_round_nobody_moved_in_changes_nothing(ranks):
    for i in range(SCENARIOS["device/replayed_all_idle"].rounds):
        for rec in rounds(ranks, "device/replayed_all_idle", i):
            assert rec["outcome"]["skipped"] is True and rec["outcome"]["total_steps"] == 0
            assert_bitwise(rec["adopted"]["params"], rec["before"]["params"])
            assert_bitwise(rec["adopted"]["buffers"], rec["before"]["buffers"])


@pytest.mark.parametrize("name", names(*IDLE))
def test_idle_rank_weighs_nothing_and_adopts_the_movers_state(ranks, name):
    steps = SCENARIOS[name].steps
    mover = next(k for k, n in enumerate(steps) if n > 0)
    mover_before = rounds(ranks, name)[mover]["before"]
    for rec in rounds(ranks, name):
        # Exactly the mover's params: the idle rank weighs 0 (not 0^0 = 1, not 0^-1 = inf).
        assert_bitwise(rec["adopted"]["params"], mover_before["params"])
        assert_bitwise(f32(rec["adopted"]["buffers"]), f32(mover_before["buffers"]))
        assert rec["outcome"]["total_steps"] == sum(steps)
        assert rec["outcome"]["skipped"] is False


@pytest.mark.parametrize("name", names(*ALL_IDLE))
def test_all_idle_round_is_skipped_and_changes_nothing(ranks, name):
    for rec in rounds(ranks, name):
        out = rec["outcome"]
        assert out["skipped"] is True
        assert out["total_steps"] == 0
        assert out["payload_bytes"] == 0
        assert out["divergence"] == 0.0
        for stage in ("after_begin", "after_finish", "adopted"):
            assert_bitwise(rec[stage]["params"], rec["before"]["params"])
            assert_bitwise(rec[stage]["buffers"], rec["before"]["buffers"])


@pytest.mark.parametrize("name", names("all_idle_exact", "all_idle_exact_one_dropped"))
def test_an_exact_round_nobody_moved_in_leaves_every_rank_the_same_state(ranks, name):
    # The run's last round: ranks apart (EASGD) must end equal even when no rank trained since the last
    # round. They take the plain mean, without a rank whose window was dropped (non-finite loss).
    recs = rounds(ranks, name)
    weights = [0.5, 0.5] if name.endswith("all_idle_exact") else [1.0, 0.0]
    for key in recs[0]["before"]["params"]:
        want = weighted([r["before"]["params"][key] for r in recs], weights)
        for rec in recs:
            assert rel_err(rec["adopted"]["params"][key], want) < 1e-6, key
    assert_bitwise(recs[0]["adopted"]["params"], recs[1]["adopted"]["params"])
    for rec in recs:
        assert rec["outcome"]["skipped"] is False and rec["outcome"]["total_steps"] == 0


# --- where the consensus lands, and when ----------------------------------------------------------


@pytest.mark.parametrize("name", names(*AVG, "easgd", backends=("host",)))
def test_host_backend_leaves_the_ranks_state_alone_until_adopt(ranks, name):
    """Training goes on while the round is in flight: neither begin nor finish touches the model."""
    for rec in rounds(ranks, name):
        assert_bitwise(rec["after_begin"]["params"], rec["before"]["params"])
        assert_bitwise(rec["after_begin"]["buffers"], rec["before"]["buffers"])
        assert_bitwise(rec["after_finish"]["params"], rec["current"]["params"])
        assert_bitwise(rec["after_finish"]["buffers"], rec["current"]["buffers"])


@pytest.mark.parametrize("name", names(*AVG, "easgd", backends=("device", "chunked")))
def test_device_backend_reduces_in_place_during_begin(ranks, name):
    want = consensus(ranks, name)
    for rec in rounds(ranks, name):
        assert_rel(rec["after_begin"]["params"], want)
        assert_rel(rec["after_begin"]["buffers"], buffer_mean(ranks, name))


@pytest.mark.parametrize("alpha_name", ["train_during_round", "easgd_train_during_round"])
def test_host_round_averages_the_snapshot_taken_at_begin(ranks, alpha_name):
    """Steps taken while the round is in flight are not in the consensus; EASGD blends from them."""
    name = f"host/{alpha_name}"
    alpha = SCENARIOS[name].alpha
    avg = consensus(ranks, name)  # from the values at begin
    for rec in rounds(ranks, name):
        now = rec["current"]["params"]
        assert not torch.equal(now["0.weight"], rec["before"]["params"]["0.weight"])
        if alpha is None:
            want = avg
        else:
            want = {k: now[k].double() + alpha * (avg[k] - now[k].double()) for k in avg}
        assert_rel(rec["adopted"]["params"], want)
        assert_rel(rec["adopted"]["buffers"], buffer_mean(ranks, name))
        pre = rec["before"]["params"]
        assert rec["outcome"]["divergence"] == pytest.approx(hand_divergence(pre, avg), rel=REL)
    assert TRAIN_DURING_ROUND != 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_easgd_blend_moves_alpha_of_the_way_to_the_consensus(ranks, backend):
    name = f"{backend}/easgd"
    alpha = SCENARIOS[name].alpha
    avg = consensus(ranks, name)
    for rec in rounds(ranks, name):
        own = rec["before"]["params"]
        want = {k: own[k].double() + alpha * (avg[k] - own[k].double()) for k in avg}
        assert_rel(rec["adopted"]["params"], want)
        # Buffers are not blended: they take the consensus.
        assert_rel(rec["adopted"]["buffers"], buffer_mean(ranks, name))
    a, b = (rec["adopted"]["params"] for rec in rounds(ranks, name))
    for k in avg:
        assert rel_err(a[k], b[k]) > 1e-3, k  # the replicas stay apart


@pytest.mark.parametrize("short", ["work_weighted", "easgd"])
def test_evaluate_runs_once_on_the_consensus_params(ranks, short):
    for backend in BACKENDS:
        name = f"{backend}/{short}"
        want = consensus(ranks, name)
        for rec in rounds(ranks, name):
            assert len(rec["evaluated"]) == 1
            assert_rel(rec["evaluated"][0]["params"], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluate_sees_the_consensus_buffers(ranks, backend):
    for short in ("work_weighted", "easgd"):
        name = f"{backend}/{short}"
        for rec in rounds(ranks, name):
            assert_rel(rec["evaluated"][0]["buffers"], buffer_mean(ranks, name))


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluate_runs_on_a_skipped_round_too(ranks, backend):
    """A skipped round still carries the epoch's eval; the coordinator waits for every rank's result."""
    for rec in rounds(ranks, f"{backend}/all_idle_gamma1"):
        assert len(rec["evaluated"]) == 1
        assert_bitwise(rec["evaluated"][0]["params"], rec["before"]["params"])


def test_device_round_without_the_own_copy_still_averages(ranks):
    """keeps_own=False: the same consensus, and no divergence (there is no pre-reduce copy)."""
    name = "device/without_own_copy"
    want = consensus(ranks, name)
    for rec in rounds(ranks, name):
        assert_rel(rec["adopted"]["params"], want)
        assert_rel(rec["adopted"]["buffers"], buffer_mean(ranks, name))
        assert rec["outcome"]["divergence"] == 0.0
        assert rec["outcome"]["total_steps"] == 4 and rec["outcome"]["skipped"] is False


# --- the bf16 wire and the outer optimizers -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_wire_sends_the_rounded_difference_from_the_shared_reference(ranks, backend):
    name = f"{backend}/bf16_wire"
    weights = hand_weights(SCENARIOS[name].steps, SCENARIOS[name].gamma)
    recs = rounds(ranks, name)
    ref = ranks[0][name]["constructed"]["params"]  # the same on every rank after the broadcast
    exact = consensus(ranks, name)
    for rec in recs:
        got = rec["adopted"]["params"]
        for k, want in exact.items():
            moved = sum(
                abs(w) * (r["before"]["params"][k].double() - ref[k].double()).abs()
                for w, r in zip(weights, recs, strict=True)
            )
            # bf16 keeps 8 significant bits of each rank's weighted difference (round to nearest).
            bound = 2.0**-8 * moved + 1e-6 * (want.abs() + moved)
            assert bool(((got[k].double() - want).abs() <= bound).all()), k
        params, buffers = rec["before"]["params"], f32(rec["before"]["buffers"])
        assert rec["outcome"]["payload_bytes"] == 2 * numel(params) + 4 * numel(buffers)
    a, b = (rec["adopted"]["params"] for rec in recs)
    assert_bitwise(a, b)


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A model's parameters in the averager's flat order (named_parameters'), float64."""
    return torch.cat([t.double().reshape(-1) for t in tensors.values()])


def hand_quantized(x: torch.Tensor, levels: int) -> torch.Tensor:
    """`x` rounded as a quantized wire rounds it: per block of BLOCK, to multiples of max |x| / levels."""
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), BLOCK):
        part = x[start : start + BLOCK]
        scale = part.abs().max() / levels
        if scale > 0:
            out[start : start + BLOCK] = (part / scale).round() * scale
    return out


@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_wire_rounds_each_change_per_block_and_sends_the_rounding_along(ranks, backend, wire):
    name = f"{backend}/{wire}_wire"
    spec, quantized = SCENARIOS[name], WIRES[wire]
    assert isinstance(quantized, QuantizedWire) and spec.wire is quantized
    levels = quantized.levels
    weights = hand_weights(spec.steps, spec.gamma)
    ref = flat(ranks[0][name]["constructed"]["params"])  # the same on every rank after the broadcast
    feedback = [torch.zeros_like(ref) for _ in weights]
    for i in range(spec.rounds):
        recs = rounds(ranks, name, i)
        own = [flat(r["before"]["params"]) for r in recs]
        exact = weighted(own, weights)
        bound = torch.zeros_like(ref)
        sent = []
        for k, weight in enumerate(weights):
            intended = own[k] - ref + feedback[k]
            sent.append(hand_quantized(intended, levels))
            # This round's rounding (half a block's scale) and what the rank's last round left out.
            bound += weight * (intended.abs().max() / (2 * levels) + feedback[k].abs())
            feedback[k] = intended - sent[k]
        hand = ref + weighted(sent, weights)
        for rec in recs:
            got = flat(rec["adopted"]["params"])
            assert float((got - hand).abs().max()) <= 1e-6 * (1 + float(hand.abs().max())), i
            assert bool(((got - exact).abs() <= bound + 1e-6).all()), i
            params, buffers = rec["before"]["params"], f32(rec["before"]["buffers"])
            sent_bytes = quantized.payload_bytes(numel(params)) + 4 * numel(buffers)
            assert rec["outcome"]["payload_bytes"] == sent_bytes
            assert_rel(rec["adopted"]["buffers"], buffer_mean(ranks, name, i))
        assert_bitwise(*(rec["adopted"]["params"] for rec in recs))
        if i > 0:  # a wire that forgot the first round's rounding lands elsewhere
            forgetful = ref + weighted([hand_quantized(o - ref, levels) for o in own], weights)
            assert float((flat(recs[0]["adopted"]["params"]) - forgetful).abs().max()) > 1e-4
        ref = flat(recs[0]["adopted"]["params"])


def hand_globals(ranks: list[dict], name: str) -> list[dict[str, torch.Tensor]]:
    """Per round of `name`, the global parameters its outer optimizer steps to from the round's consensus
    (the shared start: the parameters every rank was built with)."""
    settings = OuterSettings.resolve(SCENARIOS[name].outer, None, None)
    assert settings is not None
    lr, mu = settings.lr, settings.momentum
    glob = {k: v.double() for k, v in ranks[0][name]["constructed"]["params"].items()}
    velocity: dict[str, torch.Tensor] = {}
    globals_ = []
    for i in range(SCENARIOS[name].rounds):
        avg = consensus(ranks, name, i)
        for k in glob:
            g = glob[k] - avg[k]
            velocity[k] = g if i == 0 else mu * velocity[k] + g
            step = g + mu * velocity[k] if settings.kind == "diloco" else velocity[k]
            glob[k] = glob[k] - lr * step
        globals_.append(dict(glob))
    return globals_


@pytest.mark.parametrize("name", names("slowmo", "diloco"))
def test_outer_optimizer_steps_the_global_params_on_the_pseudo_gradient(ranks, name):
    kind = name.split("/")[1]
    for i, glob in enumerate(hand_globals(ranks, name)):
        avg = consensus(ranks, name, i)
        for rec in rounds(ranks, name, i):
            assert_rel(rec["adopted"]["params"], glob)
            assert_rel(rec["adopted"]["buffers"], buffer_mean(ranks, name, i))
            if i > 0 or kind == "diloco":  # (slowmo's first step at lr=1 lands on the consensus)
                assert all(rel_err(rec["adopted"]["params"][k], avg[k]) > 1e-3 for k in avg)
        a, b = (rec["adopted"]["params"] for rec in rounds(ranks, name, i))
        assert_bitwise(a, b)


@pytest.mark.parametrize("name", ["host/overlapped", "host/overlapped_diloco"])
def test_an_overlapped_round_lands_late_keeping_what_each_rank_trained_since_its_snapshot(ranks, name):
    """params = the round's result + (params now - params at begin), where the result is the consensus of
    the snapshots (DiLoCo: its outer step from them); the eval runs on the result itself, float32 buffers
    take the consensus's."""
    spec = SCENARIOS[name]
    results = (
        hand_globals(ranks, name)
        if spec.outer != "avg"
        else [consensus(ranks, name, i) for i in range(spec.rounds)]
    )
    for i, result in enumerate(results):
        recs = rounds(ranks, name, i)
        for rec in recs:
            before, now = rec["before"]["params"], rec["current"]["params"]
            assert_rel(
                rec["adopted"]["params"],
                {k: result[k] + now[k].double() - before[k].double() for k in result},
            )
            assert_rel(rec["evaluated"][0]["params"], result)
            assert_rel(rec["adopted"]["buffers"], buffer_mean(ranks, name, i))
            assert rec["outcome"]["divergence"] == pytest.approx(hand_divergence(before, result), rel=REL)
        # Rank 1 trained twice what rank 0 did meanwhile: the ranks stay apart by that, and only by that.
        a, b = (rec["adopted"]["params"] for rec in recs)
        for k in result:
            assert torch.allclose(b[k] - a[k], torch.full_like(a[k], TRAIN_DURING_ROUND), atol=1e-5), k


# --- the flat storage ----------------------------------------------------------------------------


def test_params_and_buffers_stay_views_into_the_flat_storage(ranks):
    for rank in ranks:
        v = rank["views"]
        assert v["n_param_groups"] == 1  # all float32
        assert v["ids_kept"] and v["same_objects_as_optimizer"] and v["ids_kept_after_round"]
        assert v["shapes_after"] == v["shapes_before"] == [(4, 5), (4,), (4,), (4,), (3, 4), (3,)]
        assert all(v["shares_param_storage"]) and all(v["shares_buffer_storage"])
        # The optimizer step and the BN forward wrote through to the averager's flat buffers.
        assert not torch.equal(v["flat_after_step"], v["flat_before"])
        assert torch.equal(v["flat_after_step"], v["params_after_step"])
        assert not torch.equal(v["buf_after_step"], v["buf_before"])
        assert torch.equal(v["buf_after_step"], v["buffers_after_step"])


def test_round_after_training_updates_the_models_parameters(ranks):
    weights = hand_weights(VIEW_STEPS, 1.0)
    pre = [r["views"]["pre_round"] for r in ranks]
    want = {k: weighted([p["params"][k] for p in pre], weights) for k in pre[0]["params"]}
    # Only the weights drift: around train-mode BN the biases get the same gradient on both ranks.
    drifted = [k for k in want if rel_err(pre[0]["params"][k], pre[1]["params"][k]) > 1e-4]
    assert len(drifted) >= 3
    for rank in ranks:
        got = rank["views"]["adopted"]["params"]
        assert_rel(got, want)
        for k in drifted:
            assert not torch.equal(got[k], rank["views"]["pre_round"]["params"][k]), k
        assert rank["views"]["outcome"]["total_steps"] == sum(VIEW_STEPS)
    assert_bitwise(ranks[0]["views"]["adopted"]["params"], ranks[1]["views"]["adopted"]["params"])
