"""GPT-2's real shape (issue 43), its CPU-checkable parts: the 50k-vocabulary task composes at 124M
parameters, the chunked loss equals the whole-logits loss and its gradients, the BPE corpus is trained and
cached once, and float8 linears keep the Parameters everything else holds."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch._inductor.custom_graph_pass import CustomGraphPass

from flodl.averaging.flat import flatten_float32_buffers, flatten_parameters, rank_own_buffers
from flodl.tasks.bpe import bpe_text, next_token_bits, token_bytes
from flodl.tasks.chunked_ce import chunked_cross_entropy
from flodl.tasks.gpt import GPT
from flodl.worker.float8 import Float8Linear, convert_to_float8, restore_scaling, scaling_state
from flodl.worker.rank_state import restore_stepper, stepper_state
from tests.helpers.corpus import fake_library
from tests.helpers.digits_stepper import digits_stepper, train_steps
from tests.helpers.float8 import CPU_FLOAT8, GPU_FLOAT8
from tests.helpers.procs import CONF, train

TASK = CONF / "task" / "gpt2_124m.yaml"


def test_gpt2_124m_has_gpt2s_shape_and_a_padded_vocabulary() -> None:
    cfg = OmegaConf.load(TASK)
    with torch.device("meta"):
        model = instantiate(cfg.task.model)
    params = sum(p.numel() for p in model.parameters())
    assert 123e6 <= params <= 125e6  # GPT-2 small, tied embeddings, no biases
    assert model.tokens.weight.shape == (50304, 768) and model.head.weight is model.tokens.weight
    assert cfg.task.model.vocab % 128 == 0 and cfg.task.model.vocab >= cfg.task.train_data.vocab_size == 50257


@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_the_chunked_loss_and_its_gradients_are_the_whole_logits_ones(chunk: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(40, (23,))
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    (hidden_grad, weight_grad) = torch.autograd.grad(expected * 3.0, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, chunk)
    torch.testing.assert_close(got, expected)
    (got_hidden, got_weight) = torch.autograd.grad(got * 3.0, (hidden, weight))
    torch.testing.assert_close(got_hidden, hidden_grad)
    torch.testing.assert_close(got_weight, weight_grad)
    with torch.no_grad():  # eval: the loss alone
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunk), got.detach())


def test_the_compiled_chunked_loss_is_the_eager_one() -> None:
    """Under torch.compile the softmax gradient is one expression (fused by the compiler), eager it is made in
    place: the same loss and gradients either way."""
    torch.manual_seed(0)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(40, (23,))
    compiled = torch.compile(chunked_cross_entropy, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (chunked_cross_entropy, compiled):
        loss = fn(hidden, weight, targets, 7)
        results.append((loss, *torch.autograd.grad(loss * 3.0, (hidden, weight))))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want)


@CPU_FLOAT8
def test_the_float8_chunked_loss_is_close_to_the_exact_one() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(48, 32, requires_grad=True)
    weight = (torch.randn(64, 32) * 0.2).requires_grad_()
    targets = torch.randint(64, (48,))
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    want = torch.autograd.grad(expected, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, 16, float8=True)
    # e4m3 keeps 3 mantissa bits, e5m2 (the softmax gradient) 2: a few percent, averaged over the products.
    assert abs(float(got.detach()) / float(expected.detach()) - 1) < 0.03
    for g, w in zip(torch.autograd.grad(got, (hidden, weight)), want, strict=True):
        assert float((g - w).norm() / w.norm()) < 0.15


def test_a_gpt_with_loss_chunks_trains_as_one_without() -> None:
    torch.manual_seed(0)
    whole = GPT(layers=1, dim=32, heads=2, context=16, vocab=96, loss_chunk=None)
    chunked = GPT(layers=1, dim=32, heads=2, context=16, vocab=96, loss_chunk=10)
    chunked.load_state_dict(whole.state_dict())
    idx, targets = torch.randint(96, (3, 16)), torch.randint(96, (3, 16))
    losses = [model(idx, targets) for model in (whole, chunked)]
    torch.testing.assert_close(losses[1], losses[0])
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_a_gpt_without_its_own_autocast_runs_in_the_callers() -> None:
    """precision=bf16 (or fp8) with task.model.amp=false: the stepper's autocast must reach the matmuls (an
    autocast(enabled=False) inside the model would run it all in float32)."""
    model = GPT(layers=1, dim=32, heads=2, context=8, vocab=64, amp=False)
    seen = []
    first_linear = next(m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(64, (2, 8)))
    assert seen == [torch.bfloat16]


def test_chunked_loss_refuses_shapes_it_cannot_pair() -> None:
    with pytest.raises(ValueError, match=r"expected hidden \(rows, dim\) and targets \(rows,\)"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), 0)


def test_the_bpe_corpus_is_trained_once_cached_and_counts_its_bytes(tmp_path: Path) -> None:
    corpus, cache = tmp_path / "lib", tmp_path / "cache"
    fake_library(corpus, 30)
    args = {"vocab_size": 300, "max_bytes": 10**6, "tokenizer_bytes": 10**6, "root": str(corpus)}
    data = bpe_text("train", context=8, cache_dir=str(cache), **args)
    assert data.tokens.dtype == torch.int32 and int(data.tokens.max()) < 300
    (folder,) = cache.iterdir()
    cached = {p.name: p.stat().st_mtime_ns for p in folder.glob("[!.]*")}
    again = bpe_text("train", context=8, cache_dir=str(cache), **args)
    assert torch.equal(again.tokens, data.tokens)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("[!.]*")} == cached  # read back, not rebuilt
    sizes = token_bytes(300, 10**6, str(corpus), str(cache))
    text = b"".join(p.read_bytes() + b"\n\n" for p in sorted_train_files(corpus))
    # Every byte of the text is spelt by exactly one token: their byte counts sum to the text's length.
    assert int(sizes[data.tokens.long()].sum()) == len(text)


def sorted_train_files(root: Path) -> list[Path]:
    from flodl.tasks.gpt import stdlib_files

    return stdlib_files("train", str(root))


def test_bits_per_byte_is_nats_per_token_over_bytes_per_token() -> None:
    torch.manual_seed(0)
    model = GPT(layers=1, dim=16, heads=2, context=4, vocab=8)
    inputs, targets = torch.randint(8, (2, 4)), torch.randint(8, (2, 4))
    sizes = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4])
    with torch.no_grad():  # as flodl's eval runs it
        sums = next_token_bits(model, [inputs, targets], sizes)
        mean = float(model(inputs, targets))
    assert float(sums["loss"]) == pytest.approx(mean * 2)
    expected = mean * targets.numel() / int(sizes[targets].sum()) / math.log(2)
    assert float(sums["bits_per_byte"]) == pytest.approx(expected * 2)


def test_float8_conversion_keeps_the_parameters_and_skips_what_it_cannot_run() -> None:
    torch.manual_seed(0)
    model = GPT(layers=1, dim=32, heads=2, context=16, vocab=64, bias=False)
    odd = torch.nn.Linear(30, 32)
    model.add_module("odd", odd)
    before = {name: p for name, p in model.named_parameters()}
    converted = convert_to_float8(model)
    assert converted and all(isinstance(model.get_submodule(n), Float8Linear) for n in converted)
    assert (
        "head" not in converted and "odd" not in converted
    )  # tied to the embedding; 30 is no multiple of 16
    assert {name: p for name, p in model.named_parameters()} == before  # the very same objects
    with pytest.raises(ValueError, match=r"precision=fp8: the model has no nn\.Linear that float8 can run"):
        convert_to_float8(torch.nn.Sequential(torch.nn.Linear(30, 30)))


def test_a_gpt_can_keep_its_blocks_out_of_float8_and_take_its_output_layer_in() -> None:
    """gpt2_124m's float8_blocks=false: no block linear converted; the GPT itself runs its chunked loss's
    output-layer matmuls in float8, through the same (tied) Parameters."""
    model = GPT(layers=1, dim=32, heads=2, context=16, vocab=64, loss_chunk=16, float8_blocks=False)
    before = {name: p for name, p in model.named_parameters()}
    assert convert_to_float8(model) == [""]  # the model itself, nothing else
    assert model.float8_loss and not any(isinstance(m, Float8Linear) for m in model.modules())
    assert {name: p for name, p in model.named_parameters()} == before
    assert model.head.weight is model.tokens.weight
    without_chunks = GPT(layers=1, dim=32, heads=2, context=16, vocab=64, float8_blocks=False)
    with pytest.raises(ValueError, match=r"precision=fp8: the model has no nn\.Linear that float8 can run"):
        convert_to_float8(without_chunks)  # nothing it could take float8 in


def test_a_converted_model_computes_with_the_flat_buffers_the_averager_writes() -> None:
    """A round writes the consensus into the flat buffer in place: the float8 layers must read it there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    (flat,) = flatten_parameters(model)
    convert_to_float8(model)
    start, end = flat.buffer.data_ptr(), flat.buffer.data_ptr() + flat.buffer.numel() * 4
    assert all(start <= p.data_ptr() < end for p in model.parameters())
    x = torch.randn(16, 32)
    before = model(x)
    flat.buffer.mul_(0.0)  # as a round's in-place consensus would: every weight and bias now zero
    assert torch.count_nonzero(model(x)) == 0 and torch.count_nonzero(before) > 0


def test_a_float8_linear_is_close_to_its_matmul_both_ways() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    reference = torch.nn.Linear(64, 48)
    reference.load_state_dict(layer.state_dict())
    convert_to_float8(layer_holder := torch.nn.Sequential(layer))
    assert isinstance(layer_holder[0], Float8Linear)
    x = torch.randn(2, 16, 64)
    layer(x).square().sum().backward()  # a first step: the maxima the next one casts with
    layer.zero_grad()
    x = x.requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, expected = layer(x), reference(x_ref)
    assert out.shape == expected.shape
    # e4m3 keeps 3 mantissa bits: a few percent per product, averaged over 64 of them.
    assert float((out - expected).detach().norm() / expected.detach().norm()) < 0.08
    out.square().sum().backward()
    expected.square().sum().backward()
    for got, want in ((x.grad, x_ref.grad), (layer.weight.grad, reference.weight.grad)):
        assert float((got - want).norm() / want.norm()) < 0.15


def _linears_behind_a_norm_and_a_gelu() -> torch.nn.Sequential:
    """Two linears whose inputs a layer norm and a GELU make: the producers a float8 cast joins, compiled."""
    return torch.nn.Sequential(
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 128, bias=False),
        torch.nn.GELU(),
        torch.nn.Linear(128, 48, bias=False),
    )


@pytest.mark.multiproc  # inductor compiles its C++ kernels with g++
@pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", marks=CPU_FLOAT8), pytest.param("cuda", marks=[pytest.mark.gpu, GPU_FLOAT8])],
)
def test_float8_casts_with_the_step_befores_maxima_compiled_as_eager(device: str) -> None:
    """The input and the gradient are cast with the scales of the maxima seen the step before, then those
    are updated. Compiled, backward passes once read the updated maxima instead: of a shared buffer's
    element (gradients 100x off), and of an input's maximum written in the forward pass (the min-cut
    partitioner recomputed its inverse scale in the backward pass from the buffer: weight gradients 20-36x
    off, behind a layer norm and a GELU). Two steps: the second casts with the first's maxima."""
    torch.manual_seed(0)
    plain = _linears_behind_a_norm_and_a_gelu().to(device)
    eager = copy.deepcopy(plain)
    convert_to_float8(eager)
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy, fullgraph=True)
    for model in (eager, compiled_copy):  # far from this step's maxima: a stale scale shows
        for layer in (model[1], model[3]):
            layer.float8_seen_input.fill_(100.0)
            layer.float8_seen_grad.fill_(100.0)
    for step in range(2):
        x = torch.randn(32, 64, device=device) * (step + 1)
        results = []
        for model, holder in ((eager, eager), (compiled, compiled_copy), (plain, plain)):
            holder.zero_grad()
            x_in = x.clone().requires_grad_()
            out = model(x_in)
            out.sum().backward()
            results.append((out.detach(), x_in.grad, *(p.grad for p in holder.parameters())))
        for got, want in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(got, want)
        for got, want in zip(results[0], results[2], strict=True):  # float8 against float32
            assert float((got - want).norm() / want.norm()) < 0.15
        for model in (eager, compiled_copy):  # this step's maxima, for the next
            assert float(model[1].float8_seen_input) == pytest.approx(float(model[0](x).abs().max()))
            assert float(model[3].float8_seen_grad) == 1.0  # d sum / d out


@CPU_FLOAT8
@pytest.mark.multiproc  # inductor compiles its C++ kernels with g++
def test_compiled_the_inputs_maxima_are_taken_in_the_forward_pass() -> None:
    """Where each maximum is taken decides the speed: in the forward pass its reduction joins the kernel that
    makes the input (a layer norm, a GELU). With nothing in the forward pass needing it, inductor's
    partitioner moved it into the backward pass, which recomputed the input for it (4% of gpt2_124m's fp8
    step on one H100). Each layer's `float8_latest_input` keeps it in the forward pass."""
    taken: list[int] = []  # row-wise maxima (amax) per compiled graph: forward, then backward

    class CountMaxima(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            taken.append(sum(node.target is torch.ops.aten.amax.default for node in graph.nodes))

        def uuid(self) -> None:  # never cached: the count is taken as it compiles
            return None

    model = _linears_behind_a_norm_and_a_gelu()
    convert_to_float8(model)
    torch._dynamo.reset()  # compile it afresh, not from an earlier test's graphs
    with torch._inductor.config.patch(post_grad_custom_pre_pass=CountMaxima(), fx_graph_cache=False):
        torch.compile(model, fullgraph=True)(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert taken == [2, 2]  # two layers: their inputs' in the forward pass, their gradients' in the backward


def test_float8s_maxima_are_each_ranks_own_and_outside_the_models_state() -> None:
    """model.pt loads into the plain model; the local-SGD rounds average, and DDP broadcasts, only the state
    buffers (a BatchNorm's statistics), never the maxima a rank saw."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 16))
    plain = copy.deepcopy(model)
    convert_to_float8(model)
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert sorted(rank_own_buffers(model)) == [
        f"{layer}.float8_{kind}" for layer in "02" for kind in ("latest_input", "seen_grad", "seen_input")
    ]
    flat = flatten_float32_buffers(model)
    assert flat is not None and flat.buffer.numel() == 2 * 32  # BatchNorm's running mean and variance
    assert model[0].float8_seen_input.data_ptr() != flat.buffer.data_ptr()
    flat.buffer.fill_(3.0)
    assert float(model[1].running_var[0]) == 3.0 and float(model[0].float8_seen_input) != 3.0
    seen = scaling_state(model)
    model.eval()  # eval, and a training-mode pass without gradients (the FLOP count), cast but see nothing
    model(torch.randn(4, 32) * 50)
    with torch.no_grad():
        model.train()(torch.randn(4, 32) * 50)
    assert all(torch.equal(scaling_state(model)[name], seen[name]) for name in seen)
    model(torch.randn(4, 32) * 50).sum().backward()  # a training step sees
    assert not torch.equal(scaling_state(model)["0"], seen["0"])


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=CPU_FLOAT8),
        pytest.param("cuda", marks=[pytest.mark.gpu, GPU_FLOAT8]),
    ],
)
def test_a_resumed_fp8_rank_casts_with_the_maxima_its_checkpoint_kept(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Exact resume: a rank restored from its state steps as the uninterrupted one, bit for bit (with the
    first step's guess instead of the kept maxima, its first cast differs)."""
    torch.manual_seed(0)
    running = digits_stepper("precision=fp8", device=device)
    train_steps(running, 6)
    # Copies, as a checkpoint's are (the optimizer's state_dict holds its live tensors).
    state, weights = copy.deepcopy((stepper_state(running), running.parts.model.state_dict()))
    assert sorted(state["float8"]) == ["net.0", "net.2"]  # the MLP's two layers of multiples of 16
    train_steps(running, 3)
    resumed = digits_stepper("precision=fp8", device=device)
    resumed.parts.model.load_state_dict(weights)
    restore_stepper(resumed, state)
    train_steps(resumed, 3)
    for (name, want), got in zip(
        running.parts.model.state_dict().items(), resumed.parts.model.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
    guessing = digits_stepper("precision=fp8", device=device)
    with caplog.at_level("INFO", logger="flodl.worker.float8"):
        restore_scaling(guessing.parts.model, {})  # a checkpoint written under bf16, or before the maxima
    assert "no maxima for 2 layers (net.0, ...): their first step guesses" in caplog.text
    assert scaling_state(guessing.parts.model)["net.0"].tolist() == [64.0, 1.0]


@pytest.mark.multiproc
def test_a_small_gpt2_124m_trains_its_bpe_corpus_from_the_cli(tmp_path: Path) -> None:
    corpus = tmp_path / "lib"
    fake_library(corpus, 40)
    result = train(
        "task=gpt2_124m",
        "task.model.layers=1",
        "task.model.dim=32",
        "task.model.heads=2",
        "task.model.context=16",
        "task.model.vocab=384",
        "task.model.loss_chunk=24",
        "task.train_data.vocab_size=300",
        f"task.train_data.root={corpus}",
        f"task.train_data.cache_dir={tmp_path / 'cache'}",
        "task.optimizer.fused=false",
        "compile=false",
        "epochs=2",
        "batch_size=4",
        cwd=tmp_path,
        timeout=300,
    )
    result.check()
    (metrics,) = tmp_path.rglob("metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert records[1]["loss"] < records[0]["loss"]
    assert 0 < records[-1]["eval/bits_per_byte"] < 8  # a byte is at most 8 bits of an untrained guess
