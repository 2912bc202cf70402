"""compile_layers: the flag wraps both models' decoder layers, and compiled layers compute what eager ones do."""

import copy

import torch

from tests.test_trainer import curriculum_path, make_trainer, tiny_model, tokenizer  # noqa: F401 (fixtures)
from trainers.model_utils import compile_decoder_layers


def test_flag_off_by_default_on_cpu_and_honoured_when_set(tmp_path, tokenizer, curriculum_path):  # noqa: F811
    tr = make_trainer(tmp_path / "a", tokenizer, curriculum_path)
    assert tr.compiled_layers is False  # default: on only with CUDA
    tr = make_trainer(tmp_path / "b", tokenizer, curriculum_path, compile_layers=True)
    assert tr.compiled_layers is True
    assert all("fwd" in layer.forward.__name__ for layer in tr.model.model.layers)
    assert all("fwd" in layer.forward.__name__ for layer in tr.teacher_model.model.layers)


def test_compiled_layers_match_eager(tokenizer):  # noqa: F811
    eager = tiny_model(tokenizer, seed=3)
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, only_with_grad=True)
    ids = torch.randint(0, 500, (2, 12))
    with torch.no_grad():  # only_with_grad: no_grad runs the eager path
        assert torch.equal(compiled(ids).logits, eager(ids).logits)
    out_c, out_e = compiled(ids).logits, eager(ids).logits  # grad on: the compiled path
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    out_c.sum().backward()
    out_e.sum().backward()
    for (n, pc), (_, pe) in zip(compiled.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert not compile_decoder_layers(torch.nn.Linear(2, 2), only_with_grad=False)


def test_varying_lengths_compile_each_layer_a_few_times_not_once_a_length(tokenizer):  # noqa: F811
    """Micro-batches are padded to their own longest sequence, so a run's lengths vary step to step. A layer compiles
    for its first shape and once more with dynamic sizes, then never again: over six lengths and two batch sizes, at
    most three graphs per layer (dynamo keys entries by layer), the eager results throughout, and no fallback."""
    from torch._dynamo.utils import counters

    from data_tools.generation import fallback

    eager = tiny_model(tokenizer, seed=3)
    compiled = copy.deepcopy(eager)
    before = counters["stats"]["unique_graphs"]
    assert compile_decoder_layers(compiled, only_with_grad=True)
    n_layers = len(compiled.model.layers)
    for b, length in ((2, 20), (2, 31), (2, 47), (2, 20), (3, 64), (2, 90), (3, 13)):
        ids = torch.randint(0, 500, (b, length))
        out_c = compiled(ids).logits
        torch.testing.assert_close(out_c, eager(ids).logits, rtol=1e-4, atol=1e-5)
        out_c.sum().backward()
    graphs = counters["stats"]["unique_graphs"] - before
    assert n_layers <= graphs <= 3 * n_layers, graphs  # dynamic=False made 6 x n_layers here
    assert not any(m.startswith("compile_layers") for m in fallback._said)


def test_recompile_limits_add_up_over_compiles():
    import torch._dynamo

    from data_tools.generation.fallback import raise_recompile_limit

    cfg = torch._dynamo.config
    limit, total = cfg.recompile_limit, cfg.accumulated_recompile_limit
    raise_recompile_limit(56)  # the student's 28 layers x 2
    raise_recompile_limit(56)  # the teacher's
    assert cfg.recompile_limit == limit + 112 and cfg.accumulated_recompile_limit == total + 112
    cfg.recompile_limit, cfg.accumulated_recompile_limit = limit, total
