"""CUDA graphs (`CudaGraphs`, `StepGraphs`): the graphed batches equal the eager ones bit for bit through real fits. On a
CPU the bookkeeping runs without the capture: `graphs='emulate'` runs each graph's Python at every call, `graphs='trace'`
records it once with make_fx and replays the recorded operators, as a CUDA graph replays its kernels"""
from contextlib import contextmanager
import pytest, torch
from rnn_darts.core import set_seed
from rnn_darts.learner import search_learner
from rnn_darts.data import lm_dls, search_stream, numbers_corpus
from rnn_darts.model import DartsRnn
from rnn_darts.genotypes import DARTS_V2
from rnn_darts.engine.graphs import StepGraphs, Captured
from rnn_darts.config import FAMILY, METHODS
from tests.test_learner import state, assert_same
from tests._learners import twin_learner

@pytest.fixture(scope='module')
def corpus():
    "The GPU twins' corpus: 19 training batches an epoch at `bptt` 10"
    return numbers_corpus(n_train=1_500, n_valid=600, n_test=400)

@pytest.fixture(scope='module')
def small():
    "The CPU fits' corpus: 6 training batches an epoch at `bptt` 10 (bs 8) and a short last one, 5 evaluation batches (eval_bs 4): each graph met more than twice"
    return numbers_corpus(n_train=500, n_valid=200, n_test=100)

SMALL = dict(nhid=8)   # the graphs' bookkeeping does not depend on the width

def outcome(learn):
    "What a fit leaves: the weights and α, the recorded losses and epoch values, the carried hidden states, the flat gradient"
    return (state(learn), [float(x) for x in learn.recorder.losses], learn.recorder.values,
            {k: v.clone() for k, v in learn.model.hidden.items()}, learn.model.flat.grad.clone())

def assert_same_fit(a, b):
    (sa, la, va, ha, ga), (sb, lb, vb, hb, gb) = outcome(a), outcome(b)
    assert_same(sa, sb)
    assert la == lb and va == vb
    assert ha.keys() == hb.keys() and all(torch.equal(ha[k], hb[k]) for k in ha)
    assert torch.equal(ga, gb)

def graph_kinds(learn):
    g = learn.cuda_graphs.graphs
    return sorted({k[0] for k, e in g.graphs.items() if e.run.captured})

CASES = [pytest.param('search', dict(mode='first'), ['arch', 'eval', 'train'], id='first', marks=pytest.mark.slow),
         pytest.param('search', dict(mode='second'), ['arch', 'eval', 'train'], id='second', marks=pytest.mark.slow),
         pytest.param('search', dict(mode='exact'), ['eval', 'train'], id='exact', marks=pytest.mark.slow),
         pytest.param('train', dict(asgd=True), ['eval', 'train'], id='train-asgd')]

@pytest.mark.parametrize('kind,kw,kinds', CASES)
def test_emulated_graphs_fit_like_eager(kind, kw, kinds, small, tmp_path):
    "Every batch through its graph's bookkeeping (static inputs, one graph per shape, the hidden-state carry, device-side learning rates) equals the eager fit bit for bit; exact mode's α step stays eager. Two epochs for first order and the training (the graphs and the carry across an epoch's end), one for the others (a second epoch would show nothing new)"
    kw = dict(kw, curvature=False) if kind == 'search' else kw   # λ_max runs eager: the graphs are the point here
    n = 1 if kw.get('mode') in ('second', 'exact') else 2
    a = twin_learner(kind, small, tmp_path/'a', graphs=False, **SMALL, **kw); a.fit(n)
    b = twin_learner(kind, small, tmp_path/'b', graphs='emulate', **SMALL, **kw); b.fit(n)
    assert a.cuda_graphs.graphs is None
    assert_same_fit(a, b)
    assert graph_kinds(b) == kinds

@contextmanager
def capturable_adam_on_cpu(learn):
    "α's Adam as on a GPU (`capturable`: its step count a tensor, no host read); torch allows that on accelerators only"
    import torch.optim.adam as A
    supported = A._get_capturable_supported_devices
    A._get_capturable_supported_devices = lambda *a, **k: [*supported(*a, **k), 'cpu']
    cb = learn.arch_param_update
    cb.arch_opt = torch.optim.Adam([learn.model.alpha], lr=cb.arch_lr, betas=cb.arch_betas, weight_decay=cb.arch_wd, capturable=True)
    try: yield
    finally: A._get_capturable_supported_devices = supported

TRACE_BPTT = 3   # a trace records every operator of the unrolled steps: fewer steps, less to record

@pytest.fixture(scope='module')
def short():
    """The traced fits' corpus: 6 training batches an epoch at TRACE_BPTT (bs 8), 6 evaluation batches (eval_bs 4), none
    shorter: a graph is recorded at its shape's second call, and a last short batch met again in a second epoch would be one
    more recording (seconds each) that shows nothing new. Each replayed graph is still met several times"""
    return numbers_corpus(n_train=150, n_valid=75, n_test=50)

@pytest.mark.slow
def test_traced_graphs_take_the_learning_rate_as_an_input(short, tmp_path):
    """A second-order search under `fit_one_cycle`, its graphs recorded once (make_fx runs the Python once, as a capture does)
    and replayed: equal to eager bit for bit, so the rate of every batch (schedule × seq_len/bptt) and the weight decay of
    the virtual step reach the replayed graphs as inputs, and dropout masks are drawn anew at every replay. ~20 s: recording
    the second-order step (make_fx over the unrolled step and both gradients) is most of it"""
    runs = []
    for graphs in (False, 'trace'):
        learn = twin_learner('search', short, tmp_path/str(graphs), graphs=graphs, mode='second', curvature=False, checkpoint=False, bptt=TRACE_BPTT, **SMALL)
        with capturable_adam_on_cpu(learn): learn.fit_one_cycle(1, 5.)
        runs.append(learn)
    assert_same_fit(*runs)
    g = runs[1].cuda_graphs.graphs
    replayed = [e for e in g.graphs.values() if e.run.captured and e.run.calls > 2]
    assert {k[0] for k, e in g.graphs.items() if e in replayed} == {'arch', 'train', 'eval'}
    lrs = runs[1].recorder.lrs
    assert len(set(lrs)) > 5   # the schedule moved the rate batch by batch

@pytest.mark.slow
def test_traced_graphs_train_a_derived_cell_like_eager(short, tmp_path):
    "The derived cell's training batches and evaluation, recorded once and replayed under `fit_one_cycle` with NT-ASGD: equal to eager bit for bit"
    runs = []
    for graphs in (False, 'trace'):
        learn = twin_learner('train', short, tmp_path/str(graphs), graphs=graphs, asgd=True, checkpoint=False, bptt=TRACE_BPTT, **SMALL)
        learn.fit_one_cycle(1, 5.)
        runs.append(learn)
    assert_same_fit(*runs)
    assert graph_kinds(runs[1]) == ['eval', 'train']

FAMILY_TRACES = [pytest.param(dict(relax='gdas', mode='mixed', beta_decay=50.), id='gdas+milenas+beta'),   # τ and β's weight move each epoch
                 pytest.param(dict(method='snas', mode='single'), id='snas'),
                 pytest.param(dict(method='drnas'), id='drnas'),
                 pytest.param(dict(method='sdarts-adv'), id='sdarts-adv')]

@pytest.mark.slow
@pytest.mark.parametrize('kw', FAMILY_TRACES)
def test_the_family_traced_fits_like_eager(kw, short, tmp_path):
    """The DARTS family's batches recorded once and replayed, as CUDA graphs run them: equal to eager bit for bit. So no part
    reads the device on the host (a capture would fail), the Gumbel and Dirichlet draws are drawn anew at each replay, τ and
    β-decay's weight reach the replayed steps as device tensors (two epochs: both move at the second), and SDARTS's attack
    keeps or reverts its perturbation on the device"""
    runs = []
    for graphs in (False, 'trace'):
        learn = twin_learner('search', short, tmp_path/str(graphs), graphs=graphs, curvature=False, checkpoint=False, bptt=TRACE_BPTT, **SMALL, **kw)
        with capturable_adam_on_cpu(learn): learn.fit(2 if kw.get('beta_decay') else 1)
        runs.append(learn)
    g = runs[1].cuda_graphs.graphs
    assert g.failed is None
    assert {k[0] for k, e in g.graphs.items() if e.run.captured and e.run.calls > 2} == {'arch', 'train', 'eval'}
    assert_same_fit(*runs)

@pytest.mark.slow
def test_a_failed_capture_falls_back_to_eager_saying_why(short, tmp_path, capsys):
    "A step that reads a value on the host cannot be captured: α's CPU Adam reads its step count. The fit goes on eager, and says so once"
    learn = twin_learner('search', short, tmp_path, graphs='trace', mode='first', curvature=False, checkpoint=False, bptt=TRACE_BPTT, **SMALL)
    learn.fit(1)
    out = capsys.readouterr().out
    assert out.count('CUDA graphs: capturing a step failed') == 1 and 'the steps run eager from here' in out
    assert learn.cuda_graphs.graphs.failed and not learn.cuda_graphs.graphs.graphs
    assert all(torch.isfinite(torch.tensor(v)).all() for v in learn.recorder.values[-1][:-1])

def test_lr_find_with_graphs_equals_eager(small, tmp_path):
    "lr_find's batches (α steps aside) go through the graphs and suggest what eager suggests, leaving the weights as they were"
    res = []
    for graphs in (False, 'emulate'):
        learn = twin_learner('search', small, tmp_path/str(graphs), graphs=graphs, **SMALL)
        w0 = state(learn)
        res.append((learn.lr_find(num_it=12, show_plot=False), [float(x) for x in learn.recorder.losses]))
        assert_same(state(learn), w0)
    assert res[0] == res[1]

def test_graphs_are_made_per_shape_on_the_second_call_and_recaptured_when_state_moves():
    "The first call of a shape runs eager (the warm-up), the second records; a shape a limit beyond runs eager; new optimizer state tensors (a checkpoint loaded) drop every graph"
    set_seed(0)
    m = DartsRnn(30, DARTS_V2, 8, 8, dropout=0.1, dropouth=0.1, dropoutx=0.1, dropouti=0.1, dropoute=0.).train()
    sg = StepGraphs(m, emulate='emulate', max_graphs=2)
    opt = torch.optim.SGD([m.flat.param], lr=0.1, momentum=0.9)
    sg.watch(opt)
    def batch(T):
        x = torch.randint(0, 30, (3, T))
        return x, x.roll(-1, 1)
    assert sg.train(*batch(5)) is not None and sg.n_captured == 0
    assert sg.train(*batch(5)) is not None and sg.n_captured == 1
    assert sg.train(*batch(6)) is not None and sg.n_captured == 1 and len(sg.graphs) == 2
    assert sg.train(*batch(7)) is None   # a third shape: over the limit, the caller runs it eager
    m.zero_grad(); opt.step()            # momentum's buffer: new state tensors
    assert sg.train(*batch(5)) is not None and len(sg.graphs) == 1 and sg.n_captured == 0

def test_the_hidden_state_is_carried_across_graphed_batches():
    "Each graphed batch starts from the state the last one left (a copy, not the graph's output buffer), as the eager forward does"
    set_seed(0)
    m = DartsRnn(30, DARTS_V2, 8, 8, dropout=0., dropouth=0., dropoutx=0., dropouti=0., dropoute=0.).train()
    xs = [torch.randint(0, 30, (3, 4)) for _ in range(3)]
    ref = []
    for x in xs:
        loss, *_ = m(x, x); loss.backward(); ref.append((loss.detach(), m.hidden['train'].clone()))
    g_ref = m.flat.grad.clone(); m.zero_grad(); m.reset()
    sg = StepGraphs(m, emulate='emulate')
    for x, (loss, h) in zip(xs, ref):
        out = sg.train(x, x)
        assert torch.equal(out[0], loss) and torch.equal(m.hidden['train'], h)
    assert torch.equal(m.flat.grad, g_ref)
    assert all(m.hidden['train'] is not e.run.out[3] for e in sg.graphs.values())

@pytest.mark.slow
@pytest.mark.parametrize('method', list(FAMILY))
def test_each_method_of_the_family_fits_as_graphs_like_eager(method, small, tmp_path):
    """(#67) Every method of the family (its relaxation, α step, perturbation, selection) through the graphs'
    bookkeeping, a training, α and evaluation graph each, equals its eager fit bit for bit over an epoch"""
    kw = dict(method=method, mode=METHODS[method]['mode'])
    a = twin_learner('search', small, tmp_path/'a', graphs=False, **SMALL, **kw); a.fit(1)
    b = twin_learner('search', small, tmp_path/'b', graphs='emulate', **SMALL, **kw); b.fit(1)
    assert_same_fit(a, b)
    assert graph_kinds(b) == ['arch', 'eval', 'train']

def test_captured_runs_its_body_then_records_then_replays():
    "`Captured` in trace mode: the first call runs the Python, the second records it (and is that call's work), later calls replay the record without the Python"
    calls, x = [], torch.zeros(())
    def body():
        calls.append(1)
        return x.add_(1).clone()
    c = Captured(body, emulate='trace')
    assert [float(c()) for _ in range(4)] == [1., 2., 3., 4.]
    assert len(calls) == 2 and c.captured
    with pytest.raises(ValueError, match="emulate must be"): Captured(body, emulate=True)

def test_graphs_say_why_they_are_off(small, tmp_path, capsys):
    "Asked for on a CPU, or with bf16, one line says why and the fit runs eager; by default on a CPU nothing is said; random search refuses them"
    for graphs, bf16, line in ((True, False, 'CUDA graphs off: they need a GPU, and the device is cpu; the steps run eager'),
                               (None, True, None), (None, False, None)):
        learn = twin_learner('train', small, tmp_path/f'{graphs}{bf16}', graphs=graphs, precision='bf16' if bf16 else 'fp32', checkpoint=False, **SMALL)
        learn.fit(1)
        out = capsys.readouterr().out
        assert (out.count(line) == 1) if line else 'CUDA graphs' not in out   # said once, by the plan
        assert learn.cuda_graphs.graphs is None and learn.plan.graphs is False
    with pytest.raises(ValueError, match="graphs true with precision bf16: bf16 autocast's cache of cast weights cannot be captured"):
        twin_learner('train', small, tmp_path/'bf16', graphs='emulate', precision='bf16', checkpoint=False, **SMALL)   # as the command line refuses it
    dls = lm_dls(small, bs=8, bptt=10, eval_bs=4, device='cpu')
    with pytest.raises(ValueError, match="graphs true: random search runs another cell every batch, and each would need its own CUDA graphs"):
        search_learner(dls, search_stream(small, 8, device='cpu'), mode='random', graphs=True, emsize=8, nhid=8)

def test_graphs_of_a_hand_built_learner_follow_the_plans_rules(capsys):
    """A learner built by hand gets its plan from what it asks (`learner_plan`): its `CudaGraphs` runs graphs where that
    plan does, random search's model (another cell per batch) is refused by the plan's rule, a loss that cannot take the
    fused one turns them off in the rule's own line; the plan is built once and kept on the learner"""
    from types import SimpleNamespace
    from rnn_darts.core import UsageError
    from rnn_darts.model import DartsRnnShared, DartsRnnSearch
    from rnn_darts.learner import SeqCrossEntropy
    from rnn_darts.engine.graphs import CudaGraphs
    def fit_start(model, loss_func):
        cb = CudaGraphs(True, emulate='emulate')
        cb.learn = SimpleNamespace(model=model, loss_func=loss_func, cbs=[cb])
        cb.before_fit()
        return cb
    with pytest.raises(UsageError, match="graphs true: random search runs another cell every batch, and each would need its own CUDA graphs"):
        fit_start(DartsRnnShared(20, 8, 8), SeqCrossEntropy())
    cb = fit_start(DartsRnnSearch(20, 8, 8), SeqCrossEntropy())
    assert cb.graphs is not None and cb.learn.plan.graphs == 'emulate' and capsys.readouterr().out == ''
    cb = fit_start(DartsRnnSearch(20, 8, 8), torch.nn.CrossEntropyLoss())   # a loss that cannot take the model's fused one
    assert cb.graphs is None and capsys.readouterr().out == "CUDA graphs off: they need the fused decoder loss (fused_loss=True); the steps run eager\n"
    plan = cb.learn.plan
    cb.before_fit()
    assert cb.learn.plan is plan and capsys.readouterr().out == ''   # built once, said once

@pytest.mark.gpu
def test_cuda_graphs_fit_like_eager_on_a_gpu(corpus, tmp_path):
    "A second-order search and a derived-cell training on CUDA: captured and replayed graphs, losses and weights within 1e-4 of eager (CUDA's embedding backward adds with atomics, in no fixed order)"
    if not torch.cuda.is_available(): pytest.skip('no CUDA device')
    for kind, kw in (('search', dict(mode='second', curvature=False)), ('train', {})):
        runs = []
        for graphs in (False, True):
            learn = twin_learner(kind, corpus, tmp_path/f'{kind}{graphs}', device='cuda', graphs=graphs, compile=False, checkpoint=False, **kw)
            learn.fit(2)
            runs.append(learn)
        g = runs[1].cuda_graphs.graphs
        assert g is not None and g.failed is None and any(e.run.graph is not None and e.run.calls > 2 for e in g.graphs.values())
        (sa, la, va, *_), (sb, lb, vb, *_) = outcome(runs[0]), outcome(runs[1])
        for k in sa: torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5, msg=k)
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-5)

@pytest.mark.gpu
@pytest.mark.parametrize('kw', FAMILY_TRACES)
def test_the_family_captures_and_fits_like_eager_on_a_gpu(kw, corpus, tmp_path, capsys):
    "The DARTS family's steps captured as CUDA graphs on a GPU and replayed: no capture fails, and the fit stays within 1e-4 of eager"
    if not torch.cuda.is_available(): pytest.skip('no CUDA device')
    runs = []
    for graphs in (False, True):
        learn = twin_learner('search', corpus, tmp_path/str(graphs), device='cuda', graphs=graphs, compile=False, checkpoint=False, curvature=False, **kw)
        learn.fit(1)
        runs.append(learn)
    g = runs[1].cuda_graphs.graphs
    assert 'capturing a step failed' not in capsys.readouterr().out and g.failed is None
    assert {k[0] for k, e in g.graphs.items() if e.run.graph is not None and e.run.calls > 2} == {'arch', 'train', 'eval'}
    (sa, la, *_), (sb, lb, *_) = outcome(runs[0]), outcome(runs[1])
    for k in sa: torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5, msg=k)
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-5)

@pytest.mark.gpu
def test_an_exact_search_captures_its_weight_steps_on_a_gpu(corpus, tmp_path, capsys):
    "The exact hypergradient runs eager (double backward) right before each graphed weight step: nothing of its autograd graph may outlive it, or the capture fails"
    if not torch.cuda.is_available(): pytest.skip('no CUDA device')
    learn = twin_learner('search', corpus, tmp_path, device='cuda', graphs=True, compile=False, checkpoint=False, mode='exact', curvature=False)
    learn.fit(1)
    g = learn.cuda_graphs.graphs
    assert 'capturing a step failed' not in capsys.readouterr().out and g.failed is None
    assert any(k[0] == 'train' and e.run.graph is not None for k, e in g.graphs.items())

@pytest.mark.gpu
def test_a_failed_capture_gives_the_cuda_generator_its_state_back():
    "A capture that fails (a host read) leaves random draws working and where they were: the eager step after it draws what it would have"
    if not torch.cuda.is_available(): pytest.skip('no CUDA device')
    run = Captured(lambda: torch.rand(4, device='cuda').sum().item())
    run()
    before = torch.cuda.get_rng_state()
    with pytest.raises(Exception): run()
    assert run.graph is None
    drawn = torch.empty(8, device='cuda').bernoulli_(.5)   # raised "Offset increment outside graph capture" without the reset
    torch.cuda.set_rng_state(before)
    assert torch.equal(drawn, torch.empty(8, device='cuda').bernoulli_(.5))

def test_the_benchs_graphed_steps_equal_its_eager_steps():
    "`rnn-darts bench --graphs` times `search_step` and `weight_step` through `StepGraphs`: here emulated, three steps equal the eager ones bit for bit"
    from rnn_darts.engine.bench import arch_updater, search_step, weight_step, _batches
    from rnn_darts.model import DartsRnnSearch
    runs = []
    for graphed in (False, True):
        set_seed(0)
        m = DartsRnnSearch(40, 8, 8).train()
        cb = arch_updater(m, 'second', graphs=StepGraphs(m, emulate='emulate') if graphed else None)
        trn, val = _batches(40, 4, 6, 2, 'cpu', 0)
        losses = [search_step(m, cb, trn, val, 'second') for _ in range(3)]
        losses.append(weight_step(m, *trn, graphs=cb.arch_path.graphs))
        runs.append((losses, state(m)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_same(runs[0][1], runs[1][1])
