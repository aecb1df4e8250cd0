"""The Runner contract on tiny float64 models of several architectures."""

import pytest
import torch

from specdecode.runners.factory import hf_runner
from specdecode.runners.hf import HFRunner
from specdecode.runners.int4 import prepare_int4

from helpers import ARCHS, TableRunner, tiny_model

TOL = 1e-10


def runners():
    for arch in ARCHS:
        yield pytest.param(lambda arch=arch: HFRunner(tiny_model(arch, seed=1)), id=arch)
    for arch in ("llama", "qwen2"):  # float32 on the int4 path: bit-exact, so TOL holds too
        yield pytest.param(lambda arch=arch: hf_runner(prepare_int4(tiny_model(arch, seed=1, dtype=torch.float32))),
                           id=f"int4-{arch}")
    yield pytest.param(lambda: TableRunner(12, seed=0), id="table")


@pytest.fixture(params=list(runners()))
def runner(request):
    return request.param()


def _ids(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def test_prefill_equals_prefill_then_forward(runner):
    ids = _ids(20, runner.vocab_size, 0)
    whole = runner.prefill(ids)  # [1, V]
    assert whole.shape == (1, runner.vocab_size)
    runner.prefill(ids[:, :13])
    pieces = runner.forward(ids[:, 13:])  # [1, 7, V]
    assert pieces.shape == (1, 7, runner.vocab_size)
    assert torch.allclose(pieces[:, -1], whole, atol=TOL, rtol=0)
    assert runner.lengths.tolist() == [20]


def test_forward_logits_match_a_fresh_pass_at_every_position(runner):
    ids = _ids(18, runner.vocab_size, 1)
    runner.prefill(ids[:, :1])
    full = runner.forward(ids[:, 1:])  # logits after tokens 1..17
    for cut in (2, 9, 17):
        runner.prefill(ids[:, :cut])
        assert torch.allclose(runner.forward(ids[:, cut:cut + 1])[:, 0], full[:, cut - 1], atol=TOL, rtol=0)


def test_truncate_then_forward_equals_fresh_pass(runner):
    ids = _ids(24, runner.vocab_size, 2)
    other = _ids(6, runner.vocab_size, 3)
    runner.prefill(ids[:, :16])
    runner.forward(other)  # tokens that will be rolled back
    runner.truncate(torch.tensor([12]))
    assert runner.lengths.tolist() == [12]
    after = runner.forward(ids[:, 12:24])
    runner.prefill(ids[:, :12])
    fresh = runner.forward(ids[:, 12:24])
    assert torch.allclose(after, fresh, atol=TOL, rtol=0)


def test_truncate_rejects_growing(runner):
    runner.prefill(_ids(5, runner.vocab_size, 4))
    with pytest.raises(ValueError):
        runner.truncate(torch.tensor([9]))


def test_ragged_calls_equal_one_row_at_a_time(runner):
    """reset(B); prefill(rows=[r]); forward(rows, counts); forward_last: each row as if alone."""
    assert runner.max_batch > 1 and runner.supports_batches
    a, b = _ids(9, runner.vocab_size, 5), _ids(6, runner.vocab_size, 6)
    block = torch.cat([_ids(4, runner.vocab_size, 7), _ids(4, runner.vocab_size, 8)])  # [2, 4]
    runner.prefill(a)
    alone_a = runner.forward(block[:1, :3])  # row 0 takes 3 of its 4 tokens
    runner.prefill(b)
    alone_b = runner.forward(block[1:])
    runner.reset(2)
    runner.prefill(b, rows=[1])
    runner.prefill(a, rows=[0])
    both = runner.forward(block, rows=[0, 1], counts=[3, 4])  # [2, 4, V]
    assert runner.lengths.tolist() == [12, 10]
    assert torch.allclose(both[0, :3], alone_a[0], atol=TOL, rtol=0) and torch.allclose(both[1], alone_b[0], atol=TOL, rtol=0)
    runner.truncate(torch.tensor([9, 6]))
    last = runner.forward_last(block.flip(0), rows=[1, 0], counts=[4, 3])  # [2, V]
    assert torch.allclose(last, torch.stack([alone_b[0, -1], alone_a[0, -1]]), atol=TOL, rtol=0)


def test_no_import_cycle_among_package_modules():
    """Every import between specdecode's modules, function-level ones included, forms no circle
    (a package's ``__init__`` run before its submodules is not counted as their import)."""
    import ast
    from pathlib import Path

    import specdecode

    root = Path(specdecode.__file__).parent
    names = {".".join(("specdecode",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {name: set() for name in names}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                # a name that is a submodule imports that module; any other name, the module it is in
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in names else module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in names and t != name)
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
