"The fused time steps (`rnn_darts.engine.fused`): Triton's kernels, run by its interpreter on a CPU, equal the eager step; a model trains through them as through the eager one"
import copy, pytest, torch
triton = pytest.importorskip("triton", reason="the fused step is Triton kernels; Triton comes with torch's CUDA wheels")
import triton.language as tl
from rnn_darts.space import SearchSpace
from rnn_darts.genotypes import DARTS_V1, DARTS_V2, ENAS, Genotype
from rnn_darts.model import DartsCell, DartsCellSearch, DartsRnn, DartsRnnSearch, DartsRnnShared
from rnn_darts.ops import OPS, PAPER_OPS, register_op
from rnn_darts.engine.plan import fused_lacks
from rnn_darts.relax import EdgeNorm
from rnn_darts.engine import fused
from rnn_darts.engine.runners import Fused
from rnn_darts.engine.fused import FusedDerivedStep, FusedPlan, FusedSearchStep, forms_of
from rnn_darts.engine.triton_ops import apply_forms

OTHER_OPS = ('gelu', 'silu', 'elu', 'softplus', 'leaky_relu', 'identity')   # none of the paper's but identity, which comes last (the eager step adds it first)
OTHER_CELL = Genotype((('gelu', 0), ('silu', 1), ('elu', 1), ('softplus', 2), ('leaky_relu', 0), ('identity', 3)), (1, 2, 3, 4, 5, 6))


def fused_and_eager(n, bs, dtype, genotype):
    "The fused step and the eager one (`DartsCell.step`) from the same input, state, mask and weights: outputs and gradients of a random loss (the weights' from the tap, as `WeightGroup` sums them)"
    torch.manual_seed(0)
    c = DartsCell(n, n, genotype).to(dtype)
    W0hT, rows = c.per_sequence(c.cut(c.block))
    Ws = [d.W for d in (W0hT, *rows)]   # W0[n:]ᵀ, then each predecessor's children's rows
    W = torch.cat(Ws).detach().requires_grad_()
    views = torch.split(W, [w.shape[0] for w in Ws])
    xw, h = torch.randn(bs, 2 * n, dtype=dtype, requires_grad=True), torch.randn(bs, n, dtype=dtype, requires_grad=True)
    mh = torch.bernoulli(torch.full((bs, n), 0.75, dtype=dtype)) / 0.75
    tap = torch.zeros(bs, W.shape[0], dtype=dtype, requires_grad=True)
    out, A = FusedDerivedStep.apply(xw, h, tap, W.detach(), mh, FusedPlan(c, h.device))
    ref = c.step(xw, h, mh, (views[0], views[1:]))
    g = torch.randn_like(out)
    gx, gh, gtap = torch.autograd.grad(out, [xw, h, tap], g)
    ends = torch.tensor([0] + [w.shape[0] for w in Ws]).cumsum(0).tolist()
    gW = torch.cat([gtap[:, a:b].t() @ A[k] for k, (a, b) in enumerate(zip(ends[:-1], ends[1:]))])
    return (out, gx, gh, gW), (ref, *torch.autograd.grad(ref, [xw, h, W], g))

@pytest.mark.parametrize('n, bs, dtype, genotype, device', [(8, 5, torch.float64, DARTS_V2, 'cpu'), (40, 19, torch.float32, ENAS, 'cpu'),
                                                            (8, 5, torch.float64, OTHER_CELL, 'cpu'),
                                                            pytest.param(40, 19, torch.float32, ENAS, 'cuda', marks=pytest.mark.gpu),
                                                            pytest.param(40, 19, torch.float32, OTHER_CELL, 'cuda', marks=pytest.mark.gpu)])
def test_the_fused_step_equals_the_eager_step(n, bs, dtype, genotype, device):
    """Output, ∂/∂input, ∂/∂state and the weights' gradient (through the tap) against autograd on the eager step. nhid 40 and
    bs 19 take two tiles of columns and two programs, both with masked edges; ENAS's cell has each of the paper's ops,
    `OTHER_CELL` six others (and s0's tanh, not among them)"""
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    with torch.device(device): res = fused_and_eager(n, bs, dtype, genotype)
    for a, b, what in zip(*res, ('output', 'input', 'state', 'weights')):
        torch.testing.assert_close(a, b, **tol, msg=what)

def search_fused_and_eager(n, bs, dtype, nodes, update, masked=True, ops=PAPER_OPS, edge_norm=False):
    """The search cell's fused step and its eager one (`DartsCellSearch.step`) from the same input, state, mask, weights,
    mixing weights (softmax(α), under edge normalisation times each edge's weight from β, as the model makes them) and
    running statistics: outputs, gradients of a random loss (the weights' from the tap; the mixing weights', α's, β's)
    and the running statistics after"""
    torch.manual_seed(0)
    c = DartsCellSearch(n, n, space=SearchSpace(ops, nodes)).to(dtype).train()
    c.bn.running_mean.normal_(); c.bn.running_var.uniform_(0.5, 2)
    ref_cell = copy.deepcopy(c)
    alpha = torch.randn(nodes * (nodes + 1) // 2, 1 + len(ops), dtype=dtype, requires_grad=True)
    beta = torch.randn(alpha.shape[0], dtype=dtype, requires_grad=edge_norm)
    probs = torch.softmax(alpha, -1) * (EdgeNorm(nodes).weights(beta)[:, None] if edge_norm else 1)
    leaving = probs[c.leaving]   # the fused step's order of the edges: by the node they leave
    W = torch.cat([c.W0[n:].t(), c.WhT]).detach().requires_grad_()
    starts = [0] + [2 * n * (j + 1) for j in range(nodes)]
    ws = [W[:2 * n]] + [W[s:] for s in starts[1:]]   # W0hT, then each node's downstream matrices
    xw, h = torch.randn(bs, 2 * n, dtype=dtype, requires_grad=True), torch.randn(bs, n, dtype=dtype, requires_grad=True)
    mh = torch.bernoulli(torch.full((bs, n), 0.75, dtype=dtype)) / 0.75 if masked else None
    tap = torch.zeros(bs, sum(w.shape[0] for w in ws), dtype=dtype, requires_grad=True)
    out, A = FusedSearchStep.apply(xw, h, tap, W.detach(), leaving, mh, c.bn, update, forms_of(ops), forms_of((c.init_op,)))
    g = torch.randn_like(out)
    mixing = [leaving, alpha] + [beta] * edge_norm
    gx, gh, gtap, *gmix = torch.autograd.grad(out, [xw, h, tap, *mixing], g, retain_graph=True)   # α's graph: the eager step's too
    ends = torch.tensor([0] + [w.shape[0] for w in ws]).cumsum(0).tolist()
    gW = torch.zeros_like(W)
    for k, (s, a, b) in enumerate(zip(starts, ends[:-1], ends[1:])): gW[s:s + b - a] += gtap[:, a:b].t() @ A[k]
    node_ws = tuple(W[2 * n * i:2 * n * (i + 1)] for i in range(1, nodes + 1))   # the eager step's weights: each node's matrix
    ref = ref_cell.step(xw, h, mh, ref_cell.prepare((ws[0], node_ws, leaving[torch.argsort(c.leaving)], update)))   # by edge
    stats = lambda cell: [cell.bn.running_mean, cell.bn.running_var, cell.bn.num_batches_tracked]
    return (out, gx, gh, gW, *gmix, *stats(c)), (ref, *torch.autograd.grad(ref, [xw, h, W, *mixing], g), *stats(ref_cell))

SPACE = dict(ops=OTHER_OPS, edge_norm=True)   # 6 ops, none of the paper's but identity, with β; 5 nodes below

@pytest.mark.parametrize('n, bs, dtype, nodes, update, masked, space, device', [
    (8, 5, torch.float64, 4, True, True, {}, 'cpu'), (40, 19, torch.float32, 2, False, False, {}, 'cpu'), (8, 5, torch.float64, 5, True, True, SPACE, 'cpu'),
    pytest.param(40, 19, torch.float32, 3, True, True, {}, 'cuda', marks=pytest.mark.gpu),
    pytest.param(40, 19, torch.float32, 5, True, True, SPACE, 'cuda', marks=pytest.mark.gpu)])
def test_the_fused_search_step_equals_the_eager_step(n, bs, dtype, nodes, update, masked, space, device):
    """The search cell's output, ∂/∂input, ∂/∂state, the weights' gradient (through the tap), the mixing weights', α's
    (and β's, edge-normalised) and the normalisation's running statistics (updated, or left alone in an architecture
    pass) against the eager step, with a dropout mask and without, for the paper's space and for 6 other ops, 5 nodes
    and β. nhid 40 and bs 19: two tiles of columns with masked edges, and the batch statistics over two blocks of rows"""
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)   # float32: the mixing weights sum bs·nhid terms
    with torch.device(device): res = search_fused_and_eager(n, bs, dtype, nodes, update, masked, **space)
    names = ('output', 'input', 'state', 'weights', 'mixing weights', 'α') + ('β',) * bool(space.get('edge_norm'))
    assert len(res[0]) == len(names) + 3
    for a, b, what in zip(*res, names + ('running mean', 'running var', 'batches'), strict=True):
        torch.testing.assert_close(a, b, **tol, msg=what)

def test_each_built_in_op_has_triton_forms_equal_to_torch():
    """Each built-in op's Triton forward and derivative (its registry entry's, run by the interpreter) against its torch
    function and autograd's derivative, in float64, on [-100, 100] and at the points where a form switches (softplus's
    threshold 20, 0)"""
    x = torch.cat([torch.linspace(-100, 100, 401, dtype=torch.float64), torch.tensor([0., -1e-9, 1e-9, 19.99, 20., 20.01], dtype=torch.float64)])
    builtin = [o for o in OPS.values() if o.builtin]
    assert {o.name for o in builtin} == {'tanh', 'relu', 'sigmoid', 'identity', 'gelu', 'silu', 'elu', 'softplus', 'leaky_relu'}
    for o in builtin:
        y, d = apply_forms(o.triton_forms(), x)
        xg = x.clone().requires_grad_()
        ref = o.fn(xg)
        torch.testing.assert_close(y, ref.detach(), rtol=1e-12, atol=1e-12, msg=f"{o.name}'s forward")
        torch.testing.assert_close(d, torch.autograd.grad(ref.sum(), xg)[0], rtol=1e-12, atol=1e-12, msg=f"{o.name}'s derivative")

@pytest.fixture
def cube():
    "A user's op without Triton forms, registered for one test"
    yield register_op('cube', lambda x: x * x * x / 8)
    del OPS['cube']

def test_an_op_without_triton_forms_is_named(cube):
    "A user's op registered without forms: `fused_lacks` names it (and only it), the fused step refuses to start, and a shared cell's genotype that uses it runs unfused"
    assert fused_lacks(('tanh', 'cube', 'gelu')) == "the fused kernels have no Triton form of cube"
    assert fused_lacks(OTHER_OPS) is None and fused_lacks(PAPER_OPS) is None
    with pytest.raises(ValueError, match='the fused step: the fused kernels have no Triton form of cube'):
        Fused(DartsCellSearch(8, 8, space=SearchSpace(("relu", "cube"), 2)))
    m = DartsRnnShared(30, 8, 8, space=SearchSpace(('relu', 'cube'), 2))
    m.runner = Fused(m.cell)   # its first cell: relu only
    m.use(Genotype((('cube', 0), ('relu', 1)), (1, 2)))
    assert fused.derived_runner(m.cell, m.cell.per_sequence(m.cell.cut(m.cell.block))) is None

@triton.jit
def softsign(x): return x / (1 + tl.abs(x))
@triton.jit
def d_softsign(x, y): return (1 - tl.abs(y)) * (1 - tl.abs(y))   # 1 / (1 + |x|)²

@pytest.fixture
def user_op():
    "A user's op with its Triton forms (checked by `register_op`), registered for one test"
    yield register_op('softsign', lambda x: x / (1 + x.abs()), triton=(softsign, d_softsign))
    del OPS['softsign']

def test_a_users_op_with_triton_forms_runs_fused(user_op):
    "A user's op registered with its forms fuses as a built-in one: the search step with it (and relu) equals the eager one, gradients included"
    assert fused_lacks(('softsign', 'relu')) is None
    res = search_fused_and_eager(8, 5, torch.float64, 2, True, ops=('softsign', 'relu'))
    for a, b in zip(*res, strict=True): torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

def test_a_batch_of_one_row_is_refused():
    "The nodes' batch statistics need 2 rows: the fused search step says so (as the eager one fails), never a NaN running variance"
    with pytest.raises(ValueError, match='needs 2 rows or more; got a batch of 1'): search_fused_and_eager(8, 1, torch.float64, 2, True)

TRITON_TYPES = {torch.float32: 'fp32', torch.float64: 'fp64', torch.int32: 'i32', torch.int64: 'i64'}

def launches(monkeypatch, run):
    "The kernel launches `run()` makes, recorded and not run: (kernel name, positional arguments, constexprs)"
    calls = []
    class Recorder:
        def __init__(self, name): self.name = name
        def __getitem__(self, grid): return lambda *args, **consts: calls.append((self.name, args, consts))
    monkeypatch.setattr(fused, '_kernel', lambda name, interpret: Recorder(name))
    run()
    return calls

RUNS = dict(derived=lambda: fused_and_eager(40, 19, torch.float32, ENAS), search=lambda: search_fused_and_eager(40, 19, torch.float32, 3, True),
            derived_other_ops=lambda: fused_and_eager(40, 19, torch.float32, OTHER_CELL),
            search_other_ops=lambda: search_fused_and_eager(40, 19, torch.float32, 5, True, ops=OTHER_OPS, edge_norm=True))

@pytest.mark.parametrize('cell', list(RUNS))
def test_every_launch_compiles_for_a_gpu(cell, monkeypatch):
    """Each kind of kernel launch of a fused time step, forward and backward, compiled by Triton for an H100 (sm_90)
    from the argument types and constexprs the step passes (the ops' forms among them: the paper's, and 6 others),
    without a GPU: the interpreter runs the kernels' Python, this their types and control flow as the GPU compiler takes
    them (0.7 s a kernel)"""
    backends = pytest.importorskip('triton.backends')
    if 'nvidia' not in backends.backends: pytest.skip("this Triton has no CUDA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    calls = launches(monkeypatch, RUNS[cell])
    kinds = {(name, tuple(sorted(consts.items()))): args for name, args, consts in calls}
    assert len(kinds) == (2 if cell.startswith('derived') else 5), sorted(kinds)   # search: s0's and the nodes' forward; h's, s0's and the nodes' backward
    for (name, consts), args in kinds.items():
        fn, consts = getattr(fused, name), dict(consts)
        sig = {n: f'*{TRITON_TYPES[a.dtype]}' if isinstance(a, torch.Tensor) else 'i32' if isinstance(a, int) else 'fp32'
               for n, a in zip(fn.arg_names, args)}
        sig.update({k: 'constexpr' for k in consts})
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        assert 'ptx' in triton.compile(src, target=GPUTarget('cuda', 90, 32)).asm, name

MODELS = dict(derived=lambda **d: DartsRnn(30, DARTS_V2, 8, 8, **d), shared=lambda **d: DartsRnnShared(30, 8, 8, **d).use(DARTS_V1),
              search=lambda **d: DartsRnnSearch(30, 8, 8, space=SearchSpace(nodes=3), **d),
              search_space=lambda **d: DartsRnnSearch(30, 8, 8, space=SearchSpace(OTHER_OPS, 5, True), **d))

@pytest.mark.slow
@pytest.mark.parametrize('kind', list(MODELS))
def test_a_model_through_the_fused_step_gives_the_eager_loss_and_gradients(kind, monkeypatch):
    """A derived model, random search's shared one (whose node matrices are copied together) and the search model (the
    paper's space, and 6 other ops over 5 nodes with β: α's gradient holds β's), with dropout: the loss, every weight's gradient (summed from the taps every 8 time steps; 10 time steps: a full stash and
    a rest) and α's, α's gradient alone in an architecture pass (no weight gradient, no tap; statistics untouched), the
    running statistics after, and an evaluation loss without gradients (the search cell's: not fused), fused against
    eager, in float64 (in float32 the search cell's batch statistics over 4 rows make the sums' order show: relative
    differences up to 1e-4)"""
    torch.manual_seed(0)
    m = MODELS[kind](dropout=0.1, dropouth=0.2, dropoutx=0.2, dropouti=0.1).to(torch.float64).train()
    search = kind.startswith('search')
    params, start = m.flat.params + (m.arch_parameters() if search else []), copy.deepcopy(m.state_dict())
    x, y = torch.randint(0, 30, (4, 10)), torch.randint(0, 30, (4, 10))
    def run():
        m.load_state_dict(start); m.reset(); m.train()
        loss = m.loss(x, y, advance=False)
        grads = torch.autograd.grad(loss, params)
        if search: grads += torch.autograd.grad(m.loss(x, y, stream='search', advance=False, weight_grads=False, update_stats=False), m.alpha)
        m.eval()
        with torch.no_grad(): ev = m.loss(x, y, stream='valid', advance=False)
        return [loss.detach(), *grads, ev, *[b.clone() for b in m.buffers()]]
    with m.frozen_masks():
        eager = run()
        m.runner = Fused(m.cell)
        launched, kernel = [], fused._kernel
        monkeypatch.setattr(fused, '_kernel', lambda name, interpret: launched.append(name) or kernel(name, interpret))
        fused_run = run()
    for a, b in zip(fused_run, eager, strict=True): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    cell = 'search' if search else 'derived'   # and the kernels did run: each training time step, forward and backward
    passes = 2 if search else 1
    assert launched.count(f'_fused_{cell}_backward') == 10 * passes and launched.count(f'_fused_{cell}_forward') >= 10 * passes, launched

@pytest.mark.slow
@pytest.mark.parametrize('kind, per_step', [('derived', 2), ('search', 7)])
def test_a_fused_time_step_is_few_kernels(kind, per_step):
    """A training step of a fused model launches per time step one kernel forward and one backward (derived), or one per
    node and direction (search, 2 nodes: s0 and 2 forward; 2, s0 and h backward), and a few more per time step (the
    tap's zero, the state's gradient, their sums): counted as `launch_count` counts, the interpreter's launches being
    profiled ranges, from 3 to 6 time steps. 12 s: the profiler records every operation of the interpreted kernels"""
    from rnn_darts.engine.bench import launch_count, weight_step
    torch.manual_seed(0)
    m = (DartsRnn(30, DARTS_V2, 8, 8) if kind == 'derived' else DartsRnnSearch(30, 8, 8, space=SearchSpace(nodes=2))).train()
    m.runner = Fused(m.cell)
    def count(T):
        x, y = torch.randint(0, 30, (4, T)), torch.randint(0, 30, (4, T))
        weight_step(m, x, y)
        return launch_count(lambda: weight_step(m, x, y))
    c3, c6 = count(3), count(6)
    assert (c3['generated'], c6['generated']) == (3 * per_step, 6 * per_step), (c3, c6)
    assert (c6['total'] - c3['total']) / 3 - per_step <= 5, (c3, c6)   # Inductor's compiled step: 34 to 55 per time step (10a_measurements)
