"The CPU's products run in the kernel measured faster on this machine, per shape and layout (issue 30)"
import json, subprocess, sys, warnings
import pytest, torch, torch.nn.functional as F
from rnn_darts.space import SearchSpace
from rnn_darts.engine import kernels
from rnn_darts.engine.kernels import linear, mm_t, machine_key, product_key, kernel_choices, fastest
from rnn_darts.model import DartsRnnSearch
from rnn_darts.engine.runners import Compiled
from rnn_darts.loss import linear_cross_entropy
from tests.test_model import ops_seen

pytestmark = pytest.mark.skipif(not kernels.ONEDNN, reason="oneDNN's fp32 inner product is not available here")

@pytest.fixture
def table(tmp_path, monkeypatch):
    "An empty table of measurements in its own file, and a process that has measured nothing yet"
    path = tmp_path / 'kernels.json'
    monkeypatch.setenv('RNN_DARTS_KERNEL_TABLE', str(path))
    for name in ('_TABLE', '_FAST', '_USED'): monkeypatch.setattr(kernels, name, {})
    return path

def planted(monkeypatch, faster, calls=None):
    "Measurements that say `faster` ('onednn' or 'aten') wins every product; `calls` collects the shapes measured"
    def time_kernels(M, K, N, a_rows=True, b_rows=True, bias=False):
        if calls is not None: calls.append((M, K, N, a_rows, b_rows, bias))
        return dict(onednn=1.0, aten=2.0) if faster == 'onednn' else dict(onednn=2.0, aten=1.0)
    monkeypatch.setattr(kernels, 'time_kernels', time_kernels)

@pytest.mark.parametrize('faster', ['onednn', 'aten'])
def test_a_product_runs_in_the_kernel_measured_faster(faster, table, monkeypatch):
    "Forward, input gradient and weight gradient each go to the kernel the measurement names; the choices are written to the table"
    calls = []
    planted(monkeypatch, faster, calls)
    a, W = torch.randn(6, 5, requires_grad=True), torch.randn(7, 5, requires_grad=True)
    names = ops_seen(lambda: torch.autograd.grad(linear(a[None], W).tanh().sum(), (a, W)))
    assert ('rnn_darts.mm_t' in names) == (faster == 'onednn') and ('aten.mm' in names) == (faster == 'aten'), names
    # forward a Wᵀ; oneDNN's backward: g W (W by columns) and the weight gradient gᵀ a (a by columns); aten's is autograd's own
    assert set(calls) == ({(6, 5, 7, True, True, False), (6, 7, 5, True, False, False), (7, 6, 5, True, False, False)}
                          if faster == 'onednn' else {(6, 5, 7, True, True, False)})
    saved = json.loads(table.read_text())[machine_key()]
    assert saved[product_key(6, 5, 7, True, True, False)]['kernel'] == faster
    assert {c['kernel'] for c in kernel_choices()} == {faster}
    got = torch.autograd.grad(linear(a, W).tanh().sum(), (a, W))
    ref = torch.autograd.grad(F.linear(a, W).tanh().sum(), (a, W))
    for g, r in zip(got, ref): torch.testing.assert_close(g, r)
    n = len(calls); linear(a, W); assert len(calls) == n   # measured once per shape

def test_the_measurement_times_both_kernels_and_picks_the_faster(table):
    "Real timings: positive for both kernels, a product 64× larger takes longer, and the recorded kernel is the faster of the two"
    torch.manual_seed(0); before = torch.get_rng_state()
    small, big = kernels.time_kernels(8, 32, 32), kernels.time_kernels(64, 256, 256)
    assert torch.equal(torch.get_rng_state(), before)   # the measurement draws from its own generator
    assert all(0 < small[k] < big[k] for k in ('onednn', 'aten')), (small, big)
    mm_t(torch.randn(64, 256), torch.randn(256, 256))
    (c,) = kernel_choices()
    assert c['kernel'] == min(('onednn', 'aten'), key=lambda k: c[f"{k}_us"]), c

def test_the_table_is_kept_per_machine_and_read_by_a_new_process(table, monkeypatch):
    "A new process takes the table's choices without measuring; another thread count is another machine key, measured anew"
    key = lambda M: product_key(M, 7, 3, True, True, False)
    table.write_text(json.dumps({machine_key(): {key(5): dict(kernel='onednn', onednn_us=1., aten_us=2.),
                                                 key(6): dict(kernel='aten', onednn_us=2., aten_us=1.)},
                                 'another CPU': {key(4): dict(kernel='onednn', onednn_us=1., aten_us=2.)}}))
    code = f"""
import torch, json
torch.set_num_threads({torch.get_num_threads()})
from rnn_darts.engine import kernels
def no(*a, **k): raise AssertionError('measured ' + repr(a))
real, kernels.time_kernels = kernels.time_kernels, no
W = torch.randn(3, 7)
print(json.dumps([kernels.onednn_faster(torch.randn(5, 7), W), kernels.onednn_faster(torch.randn(6, 7), W)]))
torch.set_num_threads({torch.get_num_threads() + 1})   # another machine key: measured
kernels.time_kernels = real
kernels.onednn_faster(torch.randn(5, 7), W)
"""
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, False]
    tab = json.loads(table.read_text())
    assert len(tab) == 3 and tab['another CPU'] and key(5) in tab[machine_key().replace(f"{torch.get_num_threads()} threads", f"{torch.get_num_threads() + 1} threads")]

RACER = """
import json, sys, time, torch
from pathlib import Path
from rnn_darts.engine import kernels
me, folder = int(sys.argv[1]), Path(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))   # the test's machine key
kernels.time_kernels = lambda *a, **k: dict(onednn=1.0, aten=2.0) if me == 0 else dict(onednn=2.0, aten=1.0)
read = kernels._read_table
def slow_read(path): tab = read(path); time.sleep(0.2); return tab   # a wide gap between reading the file and replacing it: a missing lock loses a record; with the lock the outcome is the same at any speed
kernels._read_table = slow_read
(folder / f'ready{me}').touch()
while not all((folder / f'ready{r}').exists() for r in (0, 1)): time.sleep(0.005)   # both processes started (their files): they measure at once
print(json.dumps([kernels.onednn_faster(torch.randn(M, 7), torch.randn(3, 7)) for M in (11, 12, 13, 14)]))
"""

@pytest.mark.slow
def test_processes_measuring_at_once_route_every_product_alike(table, tmp_path):
    "Two processes (the ranks of a run) measure the same new products at once, each finding the other kernel faster: both take the first record written for each product, and the table keeps all of them"
    ps = [subprocess.Popen([sys.executable, '-c', RACER, str(r), str(tmp_path), str(torch.get_num_threads())], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in ps]
    assert all(p.returncode == 0 for p in ps), [e for _, e in outs]
    a, b = (json.loads(o) for o, _ in outs)
    saved = json.loads(table.read_text())[machine_key()]
    assert a == b == [saved[product_key(M, 7, 3, True, True, False)]['kernel'] == 'onednn' for M in (11, 12, 13, 14)]

def test_an_unreadable_table_is_measured_again_with_a_warning(table, monkeypatch):
    planted(monkeypatch, 'aten')
    table.write_text('{not json')
    with pytest.warns(UserWarning, match=f"the kernel table {table} is unreadable"):
        torch.testing.assert_close(mm_t(torch.ones(2, 3), torch.ones(4, 3)), torch.full((2, 4), 3.))
    assert json.loads(table.read_text())[machine_key()][product_key(2, 3, 4, True, True, False)]['kernel'] == 'aten'

def test_a_damaged_entry_is_measured_again(table, monkeypatch):
    "An entry without a kernel or without both times (a hand-edited table) is measured again and replaced"
    planted(monkeypatch, 'onednn', calls := [])
    table.write_text(json.dumps({machine_key(): {product_key(2, 3, 4, True, True, False): dict(kernel='mkl'),
                                                 product_key(3, 3, 4, True, True, False): dict(kernel='aten', onednn_us='fast', aten_us=1.)}}))
    for M in (2, 3): mm_t(torch.ones(M, 3), torch.ones(4, 3))
    assert [c[0] for c in calls] == [2, 3]
    saved = json.loads(table.read_text())[machine_key()]
    assert all(saved[product_key(M, 3, 4, True, True, False)] == dict(kernel='onednn', onednn_us=1.0, aten_us=2.0) for M in (2, 3))

def test_kernel_can_be_set_for_every_product(table, monkeypatch):
    "kernels.KERNEL = 'onednn' / 'aten' routes every product that way without measuring; a wrong value is refused"
    planted(monkeypatch, 'aten', calls := [])
    a, W = torch.randn(4, 3), torch.randn(5, 3)
    monkeypatch.setattr(kernels, 'KERNEL', 'onednn')
    assert 'mkldnn._linear_pointwise' in ops_seen(lambda: mm_t(a, W)) and not calls
    monkeypatch.setattr(kernels, 'KERNEL', 'mkl')
    with pytest.raises(ValueError, match="rnn_darts.engine.kernels.KERNEL = 'mkl': use 'measured', 'onednn' or 'aten'"): mm_t(a, W)

def onednn_rows(fn):
    "Row counts of the `a` of every `rnn_darts::mm_t` call (a product routed to oneDNN with autograd) while `fn` runs, compiled graphs included"
    from torch.profiler import profile
    with profile(record_shapes=True) as p: fn()
    return {e.input_shapes[0][0] for e in p.events() if e.name == 'rnn_darts::mm_t'}

@pytest.mark.slow
@pytest.mark.parametrize('faster', ['onednn', 'aten'])
def test_a_compiled_step_takes_the_choices_while_traced(faster, table, monkeypatch):
    "The compiled cell step routes its products as measured (a constant of the graph Dynamo traces) and gives the eager step's gradients (AOT autograd's graph: Inductor's code for oneDNN products is tests/test_model.py's)"
    planted(monkeypatch, faster)
    torch._dynamo.reset()   # the graphs keep the choices they were traced with (no guard): trace afresh
    torch.manual_seed(0)
    m = DartsRnnSearch(50, 16, 16, dropouth=0.2, dropoutx=0.2, space=SearchSpace(nodes=3)).train()   # 3 nodes: every operator, a third of the tracing
    x, y = torch.randint(0, 50, (4, 5)), torch.randint(0, 50, (4, 5))   # the step's products have bs = 4 rows, x W0ₓ has 20
    def grads():
        m.reset(); loss = m.loss(x, y, advance=False)
        return [loss.detach(), *torch.autograd.grad(loss, [m.alpha, m.cell.block])]
    with m.frozen_masks():
        eager = grads()
        m.runner = Compiled(m.cell, backend='aot_eager')
        compiled = grads()
        rows = onednn_rows(grads)
    assert (4 in rows) == (faster == 'onednn'), rows
    for a, b in zip(eager, compiled): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

def test_a_product_first_met_while_compiling_is_measured_on_real_tensors(table):
    "Measured inside torch.compile's tracing, the times are real: at least the product's FLOPs at 1 TFLOP/s, not a fake tensor's"
    marked = lambda: 0; torch.compiler.assume_constant_result(marked)
    assert vars(marked) == vars(kernels._choose) == {'_dynamo_marked_constant': True}   # `_choose`'s mark is the decorator's
    f = torch.compile(lambda a, W: linear(a, W).sigmoid(), dynamic=False)
    a, W = torch.randn(256, 512), torch.randn(2048, 512)
    torch.testing.assert_close(f(a, W), F.linear(a, W).sigmoid(), rtol=1e-4, atol=5e-5)   # either kernel's rounding (1.2e-5 seen)
    (c,) = [c for c in kernel_choices() if c['product'] == product_key(256, 512, 2048, True, True, False)]
    flop_us = 2 * 256 * 512 * 2048 / 1e12 * 1e6
    assert min(c['onednn_us'], c['aten_us']) > flop_us, c

def test_the_decoder_takes_its_weight_in_the_faster_layout(table, monkeypatch):
    "fastest() picks the layout measured faster; the fused loss gives the same loss and gradients with either layout"
    W = torch.randn(40, 8)
    a = torch.randn(5, 8)
    Wc = W.t().contiguous().t()   # W stored by columns
    def plant(cols_faster):
        def time_kernels(M, K, N, a_rows=True, b_rows=True, bias=False):
            fast = b_rows != cols_faster
            return dict(onednn=1.0 if fast else 3.0, aten=2.0 if fast else 4.0)
        for name in ('_TABLE', '_FAST', '_USED'): monkeypatch.setattr(kernels, name, {})
        table.unlink(missing_ok=True)
        monkeypatch.setattr(kernels, 'time_kernels', time_kernels)
    x, b, y = torch.randn(30, 8, requires_grad=True), torch.randn(40, requires_grad=True), torch.randint(0, 40, (30,))
    Wd = W.clone().requires_grad_()
    results = []
    for cols in (False, True):
        plant(cols)
        assert fastest(a, W, Wc) is (Wc if cols else W)
        loss = linear_cross_entropy(x, Wd, b, y, rows=7)   # chunks of 7 rows: logits x Wᵀ + b and ∂/∂x = p W, W by rows or columns
        results.append([loss.detach(), *torch.autograd.grad(loss, (x, Wd, b))])
        used = {c['product'] for c in kernel_choices()}
        assert {product_key(7, 8, 40, True, not cols, True), product_key(7, 40, 8, True, not cols, False)} <= used, used
    loss = F.cross_entropy(F.linear(x, Wd, b), y)
    ref = [loss.detach(), *torch.autograd.grad(loss, (x, Wd, b))]
    for got in results:
        for g, r in zip(got, ref): torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
