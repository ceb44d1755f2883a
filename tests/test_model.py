"Cell equations against a plain per-edge, per-op implementation; packed/flat views; masks; determinism."
import copy, gc, math, tempfile
from pathlib import Path
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from rnn_darts.space import SearchSpace
from rnn_darts.genotypes import PRIMITIVES, PAPER_NODES, DARTS_V1, DARTS_V2, ENAS, Genotype
from rnn_darts.ops import PAPER_OPS
from rnn_darts.model import DartsRnn, DartsRnnSearch, DartsCell, DartsCellSearch
from rnn_darts.flat import FlatParams, FlatModule
from rnn_darts.engine.runners import Eager, Compiled, plain_step, tapped_step, twice_differentiable
import rnn_darts.engine.kernels as kernels
from tests._reference import plain_search_step, plain_derived_step, run_plain
from tests._devices import ON_DEVICES

# torch.compile's graphs without Inductor's code generation (~10 s a step, not ~70 s on a 2-core CPU), for the tests whose
# point is the graph (what it traces, taps and keeps alive), not the generated code. Inductor's code is checked by
# test_compiled_step_equals_eager (on a CPU at nhid 160: its large weights tapped, the products oneDNN's; on CUDA the
# plain step), test_compiled_cpu_tanh_matches_float64 and
# tests/test_bench.py's launch count
AOT = 'aot_eager'
COMPILED_STEPS = 3   # the cell of the tests that compile with Inductor (compile time grows with the cell's operators)

def batch_bn(s): return F.batch_norm(s, None, None, training=True, eps=1e-5)

SPACES = [(PAPER_OPS, PAPER_NODES), (('tanh', 'gelu', 'identity', 'silu', 'relu'), 3)]   # the paper's; other ops (identity not first), 3 nodes

@pytest.mark.parametrize('training', [False, True])
@pytest.mark.parametrize('ops,steps', SPACES)
def test_search_cell_equals_plain(training, ops, steps):
    torch.manual_seed(0)
    ninp = nhid = 6; bs, T = 5, 4
    cell = DartsCellSearch(ninp, nhid, dropoutx=0.3, dropouth=0.4, space=SearchSpace(ops, steps)).train(training)
    probs = F.softmax(torch.randn(steps * (steps + 1) // 2, 1 + len(ops)), -1).requires_grad_()
    x, h0 = torch.randn(T, bs, ninp), torch.randn(bs, nhid)
    from rnn_darts.model import MaskBank
    bank = MaskBank()
    with bank.freeze():
        out, _ = cell(x, h0, bank, 'train', probs=probs, update_stats=False)
        ones = torch.ones(bs, nhid)
        mx, mh = (bank.cache[('train', 'x')], bank.cache[('train', 'h')]) if training else (ones, ones)
        fresh = lambda s: s / (1 + 1e-5) ** 0.5                           # fresh running stats: mean 0, var 1
        bn = batch_bn if training else (lambda s: fresh(s) / fresh(s).pow(2).mean().sqrt().clamp(min=1))   # eval: mean square at most 1
        Ws = [cell.W(i) for i in range(1, steps + 1)]
        ref = run_plain(lambda xt, h: plain_search_step(xt, h, cell.W0, Ws, probs, mx, mh, lambda s, i: bn(s), ops), x, h0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # gradients w.r.t. the mixing weights and the packed block agree too
    g1 = torch.autograd.grad(out.pow(2).sum(), [probs, cell.block])
    g2 = torch.autograd.grad(ref.pow(2).sum(), [probs, cell.block])
    for a, b in zip(g1, g2): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize('genotype', [DARTS_V1, DARTS_V2, ENAS, Genotype((('gelu', 0), ('silu', 1), ('relu', 1)), (1, 2, 3))])
def test_derived_cell_equals_plain(genotype):
    torch.manual_seed(1)
    ninp = nhid = 5; bs, T = 3, 4
    cell = DartsCell(ninp, nhid, genotype, dropoutx=0.3, dropouth=0.4).train()
    from rnn_darts.model import MaskBank
    bank = MaskBank()
    x, h0 = torch.randn(T, bs, ninp), torch.randn(bs, nhid)
    with bank.freeze():
        out, _ = cell(x, h0, bank, 'train')
        mx, mh = bank.cache[('train', 'x')], bank.cache[('train', 'h')]
        Ws = [cell.W(i) for i in range(1, len(genotype.recurrent) + 1)]
        ref = run_plain(lambda xt, h: plain_derived_step(xt, h, cell.W0, Ws, genotype, mx, mh), x, h0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

def test_packed_block_views():
    cell = DartsCell(4, 4, DARTS_V2)
    for i in range(1, 9):
        W = cell.W(i)
        assert W.shape == (4, 8) and W.untyped_storage().data_ptr() == cell.block.untyped_storage().data_ptr()
    # all W_i are distinct slices that tile Wh
    cols = sorted(cell.col); assert cols == list(range(8))
    # children of one node are adjacent columns (one matmul per predecessor)
    for p, kids in cell.kids.items():
        ks = [cell.col[i - 1] for i in kids]
        assert ks == list(range(ks[0], ks[0] + len(ks))) if ks else True

def _nodes(fn, seen=None):
    "Every autograd node behind `fn`"
    seen = set() if seen is None else seen
    if fn is None or fn in seen: return seen
    seen.add(fn)
    for nxt, _ in fn.next_functions: _nodes(nxt, seen)
    return seen

def _into(block, loss):
    "The autograd nodes that hand `block` its gradient"
    return [n.name() for n in _nodes(loss.grad_fn) if any(getattr(f, 'variable', None) is block for f, _ in n.next_functions)]

@pytest.mark.parametrize('shared', [False, True])
def test_a_forward_takes_its_matrices_from_the_block_in_one_split(shared):
    "The block's gradient comes from one split's backward (one block-sized write), not a slice's per matrix (a block-sized zero tensor each, then added up), and equals the plain step's by slices; in the search cell's layout (`shared`) DARTS_V2's node 5 has children 6 and 8, not adjacent: copied out of the pieces"
    from rnn_darts.model import MaskBank
    torch.manual_seed(1)
    cell = DartsCell(5, 5, DARTS_V2, shared=shared).train()
    assert len(cell.runs()) == (8 if shared else 5)   # one run per node, or per predecessor with children (0, 1, 2, 3, 5)
    x, h0 = torch.randn(4, 3, 5), torch.randn(3, 5)
    out, _ = cell(x, h0, MaskBank(), 'train')
    g = torch.randn_like(out)
    assert _into(cell.block, (out * g).sum()) == ['SplitWithSizesBackward0']
    ref = run_plain(lambda xt, h: plain_derived_step(xt, h, cell.W0, [cell.W(i) for i in range(1, 9)], DARTS_V2, None, None), x, h0)
    torch.testing.assert_close(*(torch.autograd.grad((o * g).sum(), cell.block)[0] for o in (out, ref)))
    m = DartsRnnSearch(30, 8, 8)
    assert _into(m.cell.block, m(torch.randint(0, 30, (3, 5)))[0].logsumexp(-1).mean()) == ['SplitWithSizesBackward0']

def test_flat_views_survive_step_to_save_load(tmp_path):
    m = DartsRnnSearch(30, 8, 8)
    assert m.flat.is_packed()
    x = torch.randint(0, 30, (2, 5))
    m(x)[0].sum().backward()
    assert m.flat.grad.abs().sum() > 0 and m.alpha.grad is not None
    opt = torch.optim.SGD([m.flat.param], lr=1.)
    before = m.cell.block.detach().clone(); opt.step()
    assert not torch.equal(before, m.cell.block) and m.flat.is_packed()
    m.to('cpu'); m.double(); assert m.flat.is_packed() and m.flat.data.dtype == torch.float64
    m.float(); torch.save(m.state_dict(), tmp_path/'m.pth')
    m2 = DartsRnnSearch(30, 8, 8); m2.load_state_dict(torch.load(tmp_path/'m.pth'))
    assert m2.flat.is_packed() and torch.equal(m2.flat.data, m.flat.data) and torch.equal(m2.alpha, m.alpha)

def test_flat_views_survive_fastai_save_load(tmp_path):
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders
    from fastai.optimizer import SGD
    m = DartsRnn(30, DARTS_V2, 8, 8)
    learn = Learner(DataLoaders([], []), m, loss_func=lambda *a: 0, opt_func=SGD, splitter=lambda m: [[m.flat.param]], path=tmp_path)
    learn.create_opt()
    learn.save('w')
    saved = m.flat.data.clone()
    with torch.no_grad(): m.flat.data.add_(1.)
    learn.load('w')
    assert m.flat.is_packed() and torch.equal(m.flat.data, saved)
    assert learn.opt.param_lists[0][0] is m.flat.param

def test_alpha_not_in_flat_store():
    m = DartsRnnSearch(30, 8, 8)
    assert all(p is not m.alpha for p in m.flat.params)
    assert m.alpha.shape == (36, 5)
    n_weights = sum(p.numel() for p in m.parameters()) - m.alpha.numel()
    assert len(m.flat) == n_weights

def test_variational_masks():
    "One mask per sequence: the same units are dropped at every time step; none in eval"
    torch.manual_seed(0)
    m = DartsRnn(20, DARTS_V2, 6, 6, dropout=0.5, dropouth=0., dropoutx=0., dropouti=0., dropoute=0.).train()
    x = torch.randint(0, 20, (3, 8))
    _, raw, out = m(x)
    zero = out == 0
    assert zero.any()
    assert (zero == zero[:, :1]).all(), "dropped units must be the same at every time step"
    torch.testing.assert_close(out[~zero], raw[~zero] * 2)     # kept units scaled by 1/keep
    m.eval(); _, raw, out = m(x); assert torch.equal(raw, out)

def test_embedding_dropout_drops_whole_words():
    torch.manual_seed(0)
    m = DartsRnn(5, DARTS_V2, 4, 4, dropout=0., dropouth=0., dropoutx=0., dropouti=0., dropoute=0.5).train()
    with m.frozen_masks():
        m(torch.zeros(2, 3, dtype=torch.long))
        mask = m.masks.cache[('train', 'e')]
    assert mask.shape == (5, 1) and set(mask.flatten().tolist()) <= {0., 2.}

def test_frozen_masks_repeat_and_unfrozen_differ():
    torch.manual_seed(0)
    m = DartsRnnSearch(20, 6, 6, dropout=0.5, dropouth=0.5, dropoutx=0.5, dropouti=0.5).train()
    x = torch.randint(0, 20, (3, 4))
    with m.frozen_masks():
        m.reset(); a = m.loss(x, x, advance=False); b = m.loss(x, x, advance=False)
    assert torch.equal(a, b)
    m.reset(); c = m.loss(x, x, advance=False)
    assert not torch.equal(a, c)

def test_eval_determinism_and_streams():
    torch.manual_seed(0)
    m = DartsRnnSearch(20, 6, 6).eval()
    x = torch.randint(0, 20, (3, 4))
    a = m(x)[0]; m.reset(); b = m(x)[0]
    assert torch.equal(a, b)
    # streams keep separate states: running 'search' does not move 'valid'
    m.reset(); m(x); hv = m.hidden['valid'].clone()
    m(torch.randint(0, 20, (3, 4)), stream='search')
    assert torch.equal(m.hidden['valid'], hv) and 'search' in m.hidden
    # loss(advance=False) leaves the stream's state alone
    m.loss(x, x, 'valid', advance=False); assert torch.equal(m.hidden['valid'], hv)

def test_bad_sizes():
    for kw, name in [(dict(nhid=0, emsize=0), 'ntoken'), (dict(dropout=1.0), 'dropout'), (dict(dropoutx=-0.1), 'dropoutx')]:
        with pytest.raises(ValueError, match=name if name != 'ntoken' else 'emsize'):
            DartsRnnSearch(20, **kw)
    with pytest.raises(ValueError, match='tied'): DartsRnnSearch(20, emsize=8, nhid=6)

def test_search_genotype_follows_alpha():
    m = DartsRnnSearch(20, 6, 6)
    with torch.no_grad():
        m.alpha.zero_(); m.alpha[0, PRIMITIVES.index('relu')] = 5.
        m.alpha[1:3, PRIMITIVES.index('tanh')] = torch.tensor([0., 4.])
    g = m.genotype()
    assert g.recurrent[0] == ('relu', 0) and g.recurrent[1] == ('tanh', 1)

def test_bn_running_stats_untouched_in_arch_pass():
    "An architecture pass's loss (`update_stats=False`) leaves the running statistics; a weight step's forward moves them"
    m = DartsRnnSearch(20, 6, 6).train()
    x = torch.randint(0, 20, (3, 4))
    rm = m.cell.bn.running_mean.clone()
    m.loss(x, x, advance=False, update_stats=False)
    assert torch.equal(rm, m.cell.bn.running_mean)
    m(x); assert not torch.equal(rm, m.cell.bn.running_mean)

def test_deepcopy_and_pickle_keep_the_store_packed():
    import pickle
    m = DartsRnnSearch(30, 8, 8)
    m(torch.randint(0, 30, (2, 5)))
    for m2 in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert m2.flat.is_packed() and torch.equal(m2.flat.data, m.flat.data)
        assert m2.flat.data.data_ptr() != m.flat.data.data_ptr()

def tiny_search(steps=PAPER_NODES, **dropouts):
    "A seeded 20-word search model in training mode, with an input and a target batch"
    torch.manual_seed(0)
    m = DartsRnnSearch(20, 8, 8, **dropouts, space=SearchSpace(nodes=steps)).train()
    return m, torch.randint(0, 20, (4, 5)), torch.randint(0, 20, (4, 5))

@pytest.mark.slow
@ON_DEVICES
def test_compiled_step_equals_eager(device, monkeypatch):
    """The torch.compile fast path gives the eager numbers (outputs and α/weight gradients). A 3-node cell: every operator
    kind and a node's sum over several edges, one cold Inductor compile (about 45 s here; the 8-node cell's took 70). On a
    CPU with oneDNN the compiled step's products go through oneDNN and are checked against aten's eager ones, at nhid 160,
    every weight tapped (one `WeightGroup`). Elsewhere (CUDA; a CPU without oneDNN's fp32 product) the step's own kernels, at nhid 8"""
    onednn = device == 'cpu' and kernels.ONEDNN
    if onednn: m, (x, y), _ = onednn_search(nhid=160, T=4, steps=COMPILED_STEPS)
    else: m, x, y = tiny_search(COMPILED_STEPS, dropout=0.1, dropouth=0.2, dropoutx=0.2, dropouti=0.1)
    m, x, y = m.to(device), x.to(device), y.to(device)
    def grads():
        m.reset(); m.alpha.requires_grad_(True)
        loss = m.loss(x, y, advance=False)
        return [loss.detach()] + list(torch.autograd.grad(loss, [m.alpha, m.cell.block]))
    with m.frozen_masks():
        if onednn: monkeypatch.setattr(kernels, 'ONEDNN', False)
        eager = grads()
        if onednn:
            monkeypatch.setattr(kernels, 'ONEDNN', True); monkeypatch.setattr(kernels, 'KERNEL', 'onednn')
            torch._dynamo.reset()   # traced afresh: the graph takes the kernel choice as a constant
        m.cell.compile_step()   # the peer harness's switch: the cell's runner, compiled
        assert isinstance(m.runner, Compiled)
        compiled = grads()
    tol = dict(rtol=1e-3, atol=1e-5) if onednn else dict(rtol=1e-4, atol=1e-6)   # oneDNN against aten: another rounding
    for a, b in zip(eager, compiled): torch.testing.assert_close(a, b, **tol)
    import pickle; assert type(pickle.loads(pickle.dumps(m)).runner) is Eager   # a copy runs eager: compiled steps are their cell's

@pytest.mark.slow
def test_exact_mode_runs_with_a_compiled_step():
    "Double backward cannot go through a compiled graph: the exact HVP uses the eager step (AOT autograd's graph, as Inductor's: no Inductor compile needed to show it)"
    from rnn_darts.callbacks.arch import hypergrad_second, exact_hvp
    m, x, y = tiny_search(dropout=0., dropouth=0., dropoutx=0., dropouti=0.)
    m.alpha.requires_grad_(True)
    ref, _ = hypergrad_second(m, (x, y), (x, y), 1., 0., 0.25, hvp=exact_hvp)
    m.runner = Compiled(m.cell, backend=AOT); m.reset()
    g, _ = hypergrad_second(m, (x, y), (x, y), 1., 0., 0.25, hvp=exact_hvp)
    torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    assert m.runner.compiles

def plain_ce(x, W, b, y): return F.cross_entropy(F.linear(x, W, b), y)

@pytest.mark.parametrize('rows', [1, 4, 23, None])
def test_linear_cross_entropy_equals_plain(rows):
    "The fused, chunked decoder + cross-entropy: loss and all three gradients equal the plain two-step version"
    from rnn_darts.loss import linear_cross_entropy
    torch.manual_seed(0)
    x, W, b = torch.randn(23, 5, dtype=torch.double), torch.randn(11, 5, dtype=torch.double), torch.randn(11, dtype=torch.double)
    y = torch.randint(0, 11, (23,))
    with torch.no_grad(): torch.testing.assert_close(linear_cross_entropy(x, W, b, y, rows), plain_ce(x, W, b, y))
    leaves = [t.clone().requires_grad_() for t in (x, W, b)]
    ref = torch.autograd.grad(plain_ce(*leaves, y), leaves)
    got = torch.autograd.grad(2.5 * linear_cross_entropy(*leaves, y, rows), leaves)   # the upstream gradient scales
    for r, g in zip(ref, got): torch.testing.assert_close(g, 2.5 * r)
    assert torch.autograd.gradcheck(lambda *t: linear_cross_entropy(*t, y, rows), leaves)

def test_linear_cross_entropy_makes_only_the_needed_gradients():
    from rnn_darts.loss import LinearCrossEntropy, linear_cross_entropy
    torch.manual_seed(0)
    x, W, b, y = torch.randn(9, 4, requires_grad=True), torch.randn(7, 4), torch.randn(7), torch.randint(0, 7, (9,))
    loss = linear_cross_entropy(x, W, b, y, 4)            # detached W and b: only ∂/∂x is made and saved
    gx, gW, gb = loss.grad_fn.saved_tensors
    assert gW is None and gb is None and gx.shape == x.shape
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(plain_ce(x, W, b, y), x)[0])
    with torch.no_grad(): assert linear_cross_entropy(x, W, b, y).grad_fn is None

def test_model_loss_fused_equals_plain_and_skips_weight_grads():
    "model.loss through the fused decoder: same loss, α and weight gradients as the plain decoder + F.cross_entropy"
    torch.manual_seed(0)
    m = DartsRnnSearch(40, 12, 12, dropout=0.2, dropouth=0.1, dropoutx=0.1, dropouti=0.1).train()
    x, y = torch.randint(0, 40, (5, 7)), torch.randint(0, 40, (5, 7))
    def grads(fused, **kw):
        m.runner = Eager(fused_loss=fused); m.reset(); m.alpha.requires_grad_(True)
        loss = m.loss(x, y, advance=False, **kw)
        return [loss.detach()] + list(torch.autograd.grad(loss, [m.alpha, m.encoder.weight, m.cell.block]))
    with m.frozen_masks():
        plain, fused = grads(False), grads(True)
        for a, b in zip(plain, fused): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        m.runner = Eager(); m.reset()
        ga = torch.autograd.grad(m.loss(x, y, advance=False, weight_grads=False), m.alpha)[0]
        torch.testing.assert_close(ga, plain[1], rtol=1e-5, atol=1e-7)
        m.reset()   # a decoder weight gradient that was not asked for is not there
        assert torch.autograd.grad(m.loss(x, y, advance=False, weight_grads=False), m.decoder_bias, allow_unused=True)[0] is None

def test_fused_loss_refuses_double_backward_and_twice_differentiable_allows_it():
    torch.manual_seed(0)
    m = DartsRnnSearch(20, 8, 8).train()
    x = torch.randint(0, 20, (3, 4))
    params = m.flat.params
    with pytest.raises(RuntimeError, match='cannot be differentiated twice.*twice_differentiable'):
        torch.autograd.grad(m.loss(x, x, advance=False), params, create_graph=True)
    m.alpha.requires_grad_(True); m.reset()
    runner = m.runner
    with twice_differentiable(m):
        assert not m.runner.fused_loss and not m.runner.defer
        g = torch.autograd.grad(m.loss(x, x, advance=False), params, create_graph=True)
        assert torch.autograd.grad(sum((t ** 2).sum() for t in g), m.alpha)[0].abs().sum() > 0
    assert m.runner is runner

def test_forward_is_time_major_and_seq_cross_entropy_reads_it_without_a_copy():
    from fastai.losses import CrossEntropyLossFlat
    from rnn_darts.learner import SeqCrossEntropy
    torch.manual_seed(0)
    m = DartsRnn(30, DARTS_V2, 8, 8).train()
    x, y = torch.randint(0, 30, (4, 6)), torch.randint(0, 30, (4, 6))
    logits, raw, out = m(x)
    assert logits.shape == (4, 6, 30) and logits.transpose(0, 1).is_contiguous() and raw.transpose(0, 1).is_contiguous()
    torch.testing.assert_close(SeqCrossEntropy()(logits, y), CrossEntropyLossFlat()(logits, y))
    torch.testing.assert_close(SeqCrossEntropy()(logits.contiguous(), y), CrossEntropyLossFlat()(logits, y))

# --- per-node normalisation statistics ---------------------------------------------------------------------------

def _fwd_bwd(m, x, y):
    m.reset(); m.zero_grad()
    logits = m(x)[0]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return logits.detach(), m.flat.grad.clone(), m.alpha.grad.clone()

def test_per_node_stats_keep_training_math_bit_identical_and_update_like_batchnorm1d():
    """Training mode: outputs and every gradient bit-identical to the former shared `BatchNorm1d`; each node's running
    statistics are those of its own `BatchNorm1d` (momentum, unbiased variance, count)"""
    torch.manual_seed(0)
    m = DartsRnnSearch(20, 6, 6, dropout=0., dropouth=0., dropoutx=0., dropouti=0.).train()
    x, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 5))
    ref = copy.deepcopy(m)
    shared = nn.BatchNorm1d(6, affine=False)                    # the former implementation: one BatchNorm for all nodes
    ref.cell.norm = lambda s, i, update_stats=True: shared(s)
    per_node = [nn.BatchNorm1d(6, affine=False) for _ in range(9)]
    rec = copy.deepcopy(m)
    rec.cell.norm = lambda s, i, update_stats=True: per_node[i](s)
    for _ in range(2):
        for a, b, c in zip(_fwd_bwd(m, x, y), _fwd_bwd(ref, x, y), _fwd_bwd(rec, x, y)):
            assert torch.equal(a, b) and torch.equal(a, c)
    for i, bn in enumerate(per_node):
        assert torch.equal(m.cell.bn.running_mean[i], bn.running_mean)
        assert torch.equal(m.cell.bn.running_var[i], bn.running_var)
        assert m.cell.bn.num_batches_tracked[i] == bn.num_batches_tracked == 2 * 5
    # the nodes' statistics differ (one shared set would be wrong for most of them)
    assert not torch.allclose(m.cell.bn.running_var[0], m.cell.bn.running_var[8])
    # eval mode: node i normalised with row i
    m.eval(); rec.eval(); m.reset(); rec.reset()
    for bn in per_node: bn.eval()
    assert torch.equal(m(x)[0], rec(x)[0])

def test_old_shared_batchnorm_state_dict_loads_with_a_warning():
    m = DartsRnnSearch(20, 6, 6).train()
    m(torch.randint(0, 20, (3, 5)))
    sd = m.state_dict()
    old_mean, old_var = torch.randn(6), torch.rand(6) + 0.5
    sd['cell.bn.running_mean'], sd['cell.bn.running_var'] = old_mean, old_var          # the former layout, (nhid,)
    sd['cell.bn.num_batches_tracked'] = torch.tensor(7)
    new = DartsRnnSearch(20, 6, 6)
    with pytest.warns(UserWarning, match='shared by all nodes.*copying it to each of the 9 nodes'):
        new.load_state_dict(sd)
    assert torch.equal(new.cell.bn.running_mean, old_mean.expand(9, 6))
    assert torch.equal(new.cell.bn.running_var, old_var.expand(9, 6))
    assert new.cell.bn.num_batches_tracked.tolist() == [7] * 9
    assert torch.equal(new.flat.data, m.flat.data)
    m2 = DartsRnnSearch(20, 6, 6)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error'); m2.load_state_dict(m.state_dict())            # the new layout: no warning

@pytest.mark.slow
def test_eval_validation_measures_the_supernet():
    "After a little training, eval-mode validation (running statistics) is close to evaluation with batch statistics"
    from rnn_darts.core import set_seed
    from rnn_darts.data import numbers_corpus, lm_dls, search_stream
    from rnn_darts.learner import search_learner
    set_seed(0)
    c = numbers_corpus(seed=0, n_train=6000, n_valid=2000, n_test=500)
    dls = lm_dls(c, 16, 10, 'search', eval_bs=16, seed=0)
    learn = search_learner(dls, search_stream(c, 16), emsize=16, nhid=16, mode='first', checkpoint=False, curvature=False,
                           path=tempfile.mkdtemp(), dropout=0., dropouth=0., dropoutx=0., dropouti=0.)
    learn.remove_cb(learn.progress)
    with learn.no_logging():
        learn.fit(2)               # at lr 20 the nodes' statistics part ways, but the running ones lag the moving weights
        learn.fit(1, lr=0.5)       # a settling epoch: they catch up (without it, seed 1 at 1 thread had running worse than blended)
    running = float(learn.validate()[0])
    cell = learn.model.cell
    cell.norm = lambda s, i, update_stats=True: F.batch_norm(s, None, None, training=True, eps=1e-5)
    batch = float(learn.validate()[0])
    # the former single set of statistics, blended over all nodes (what one shared BatchNorm1d converges to)
    rm, rv = cell.bn.running_mean.mean(0), cell.bn.running_var.mean(0)
    cell.norm = lambda s, i, update_stats=True: F.batch_norm(s, rm, rv, training=False, eps=1e-5)
    blended = float(learn.validate()[0])
    del cell.norm
    # measured at 1, 2 and 4 threads over seeds 0-3 (12 trajectories, a 2-core Xeon, torch 2.14.1): running / batch 0.92-0.97,
    # blended - running 0.59-1.39. Batch statistics of one 16-row eval batch are themselves noisy, so: running is no worse
    # than batch statistics, and the blended set (the old shared BatchNorm) is far worse than both
    assert running < batch, (running, batch)
    assert blended > running + 0.3, (blended, running)

def onednn_search(nhid=128, bs=16, T=6, ntoken=300, steps=PAPER_NODES):
    "A small search model for the tests that send its products through oneDNN (`kernels.KERNEL`)"
    torch.manual_seed(0)
    m = DartsRnnSearch(ntoken, nhid, nhid, dropout=0.1, dropouth=0.2, dropoutx=0.2, dropouti=0.1, space=SearchSpace(nodes=steps)).train()
    g = torch.Generator().manual_seed(1)
    batch = lambda: (torch.randint(0, ntoken, (bs, T), generator=g), torch.randint(0, ntoken, (bs, T), generator=g))
    return m, batch(), batch()

def ops_seen(fn):
    "Names of the operators `fn` dispatches (forward and backward)"
    from torch.utils._python_dispatch import TorchDispatchMode
    class Seen(TorchDispatchMode):
        names = set()
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket)); return func(*args, **(kwargs or {}))
    with Seen() as s: fn()
    return s.names

@pytest.mark.skipif(not kernels.ONEDNN, reason="oneDNN's fp32 inner product is not available here")
@pytest.mark.parametrize('mode', ['first', 'second', 'exact'])
def test_onednn_products_give_aten_hypergradients(mode, monkeypatch):
    "Every hypergradient and the weight gradient with oneDNN's products equal aten's (float32 rounding); the products did go to oneDNN"
    from rnn_darts.engine.bench import arch_hypergrad
    m, trn, val = onednn_search()
    monkeypatch.setattr(kernels, 'KERNEL', 'onednn')   # every product, whatever was measured faster here
    def run():
        m.reset(); torch.manual_seed(2)
        g = arch_hypergrad(m, trn, val, mode)
        m.reset(); loss = m.loss(*trn)
        return [g, loss.detach(), torch.autograd.grad(loss, m.flat.params[0])[0]]   # the tied encoder/decoder
    names = ops_seen(run)
    assert {'rnn_darts.mm_t', 'mkldnn._linear_pointwise'} <= names, names
    fast = run()
    monkeypatch.setattr(kernels, 'ONEDNN', False)
    assert 'rnn_darts.mm_t' not in ops_seen(run)
    for a, b in zip(fast, run()): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)

@pytest.mark.slow
@pytest.mark.parametrize('kernel', ['aten', 'onednn'])
@pytest.mark.parametrize('derived', [False, True])
@pytest.mark.parametrize('compiled', [False, True])
def test_deferred_weight_gradients_equal_autograds_per_step_ones(kernel, derived, compiled, monkeypatch):
    "Forwards with gradients stash the products and sum the weight gradient every 8 steps (compiled: through one `WeightGroup`'s taps in AOT autograd's graph; Inductor's code for taps is test_compiled_step_equals_eager's, at nhid 160); it equals autograd's per-step sum"
    from rnn_darts.model import Deferred
    if kernel == 'onednn' and not kernels.ONEDNN: pytest.skip("oneDNN's fp32 inner product is not available here")
    monkeypatch.setattr(kernels, 'KERNEL', kernel)
    if compiled: torch._dynamo.reset()
    nhid = 16
    torch.manual_seed(0)
    drop = dict(dropout=0.1, dropouth=0.2, dropoutx=0.2, dropouti=0.1)
    m = (DartsRnn(50, DARTS_V2, nhid, nhid, **drop) if derived else DartsRnnSearch(50, nhid, nhid, **drop)).train()
    x, y = torch.randint(0, 50, (16, 19)), torch.randint(0, 50, (16, 19))   # 19 steps: two full stashes and a rest
    calls = []
    if compiled:
        m.runner = Compiled(m.cell, tap_min_numel=0, backend=AOT)   # taps at this size too
        tapped = m.runner.tapped
        m.runner.tapped = lambda *a: calls.append(1) or tapped(*a)
    def grads():
        m.reset()
        ctx = m.runner.resolve(m.cell.per_sequence(m.cell.cut(m.cell.block), **m.cell_inputs()))   # the weights this forward's runner defers
        loss = m.loss(x, y, advance=False)
        return ctx, [loss.detach(), *torch.autograd.grad(loss, m.flat.params)]
    with m.frozen_masks():
        ctx, deferred = grads()
        assert isinstance(ctx[0], Deferred)
        assert len(calls) == (19 if compiled else 0)   # every time step ran the compiled step with taps
        with twice_differentiable(m): ctx, per_step = grads()
        assert not isinstance(ctx[0], Deferred) and len(calls) == (19 if compiled else 0)
    with torch.no_grad():
        assert not isinstance(m.runner.resolve(m.cell.per_sequence(m.cell.cut(m.cell.block), **m.cell_inputs()))[0], Deferred)
    for a, b in zip(deferred, per_step): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

@pytest.mark.slow
@pytest.mark.parametrize('derived', [False, True])
@pytest.mark.parametrize('compiled', [False, True])
def test_bf16_deferred_weight_gradients_equal_the_per_step_ones(derived, compiled, monkeypatch):
    "Inside a CPU bf16 autocast the weights' gradients are deferred too: the steps multiply by bf16 copies made once, and every 8 steps one bf16 product sums their gradients into float32; they equal the per-step sums by the weights cast once (`Cast`), up to bf16's rounding of each product's result"
    from rnn_darts.model import Deferred
    if compiled: torch._dynamo.reset()
    torch.manual_seed(0)
    m = (DartsRnn(50, DARTS_V2, 16, 16, dropouth=0.2, dropoutx=0.2) if derived else DartsRnnSearch(50, 16, 16, dropouth=0.2, dropoutx=0.2)).train()
    x, y = torch.randint(0, 50, (16, 19)), torch.randint(0, 50, (16, 19))   # 19 steps: two full stashes and a rest
    if compiled: m.runner = Compiled(m.cell, tap_min_numel=0, backend=AOT)
    def grads():
        m.reset()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            ctx = m.runner.resolve(m.cell.per_sequence(m.cell.cut(m.cell.block), **m.cell_inputs()))
            loss = m.loss(x, y, advance=False)
        return ctx, [loss.detach(), *torch.autograd.grad(loss, m.flat.params)]
    with m.frozen_masks():
        ctx, deferred = grads()
        assert isinstance(ctx[0], Deferred)
        monkeypatch.setattr(Eager, 'defers', lambda self, W: False)
        ctx, per_step = grads()
        assert isinstance(ctx[0], kernels.Cast)
    assert all(g.dtype == torch.float32 for g in deferred)
    for a, b in zip(deferred, per_step): torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-4)

@pytest.mark.slow
def test_compiled_cpu_tanh_matches_float64():
    "The cells' tanh inside a compiled CPU graph (a rational function, not Inductor's tanh): values and derivative against float64"
    from rnn_darts.model import tanh
    x = torch.cat([torch.linspace(-30, 30, 20_001), torch.logspace(-30, 1, 3_001), -torch.logspace(-30, 1, 3_001), torch.tensor([0., 7.9, -7.91, 3e38, -float("inf")])])
    xc = x.clone().requires_grad_()
    y = torch.compile(tanh)(xc)
    g, = torch.autograd.grad(y.sum(), xc)
    ref = torch.tanh(x.double())
    torch.testing.assert_close(y.double(), ref, rtol=4e-7, atol=1e-37)
    torch.testing.assert_close(g.double(), 1 - ref ** 2, rtol=0, atol=1e-6)
    assert torch.equal(tanh(x), torch.tanh(x))   # eager: torch's own

def test_deferred_weight_gradients_again_with_retain_graph():
    "A second backward through the same graph (retain_graph) gives the same weight gradients, not their running sum"
    torch.manual_seed(0)
    m = DartsRnn(50, DARTS_V2, 8, 8).train()
    loss = m.loss(torch.randint(0, 50, (12, 4)), torch.randint(0, 50, (12, 4)), advance=False)
    first = torch.autograd.grad(loss, m.flat.params, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(loss, m.flat.params)): torch.testing.assert_close(a, b)

@pytest.mark.parametrize('derived', [False, True])
def test_a_compiled_time_step_takes_one_tensor_with_a_gradient_per_kind(derived, monkeypatch):
    """A compiled step with weight gradients takes, besides its state, one tap for all its weights' products (`WeightGroup`)
    and, in the search cell, one tensor of mixing weights: so each time step's backward adds one gradient into each, not
    one per weight, edge and op (which were about 50 additions per time step). The step runs eager behind the counter"""
    torch.manual_seed(0)
    m = (DartsRnn(50, DARTS_V2, 8, 8) if derived else DartsRnnSearch(50, 8, 8)).train()
    cell, seen = m.cell, []
    def tapped(xw_t, h, mh, ctx):
        grads = {id(t): t for t in torch.utils._pytree.tree_leaves(ctx) if isinstance(t, torch.Tensor) and t.requires_grad}
        seen.append(grads)   # the tensors too: kept alive, their ids stay theirs
        return tapped_step(cell, xw_t, h, mh, ctx)
    m.runner = Compiled(cell, tap_min_numel=0)   # taps at this size too; compiles nothing until called: its functions replaced here
    m.runner.plain, m.runner.tapped = lambda *a: plain_step(cell, *a), tapped
    x, y = torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))
    with m.frozen_masks():
        loss = m.loss(x, y, advance=False)
        assert len(seen) == 6 and all(len(s) == (1 if derived else 2) for s in seen)
        assert len(set.intersection(*map(set, seen))) == (0 if derived else 1)   # the mixing weights: one tensor for the sequence; the taps: one per step
        with torch.no_grad(): ref = m.loss(x, y, advance=False)   # no weight gradient: the plain step
    torch.testing.assert_close(loss.detach(), ref)
    assert len(seen) == 6

def test_compiled_forwards_tap_their_weights_only_if_the_largest_is_big():
    """A compiled forward with weight gradients taps its weights (one `WeightGroup`) if the largest product's (elements × row
    blocks) has its plan's `tap_min_numel` (by default `TAP_MIN_NUMEL`), else keeps per-step gradients; the steps run eager behind the counters"""
    from rnn_darts.engine.plan import TAP_MIN_NUMEL, ExecutionPlan
    from rnn_darts.engine.runners import runner_of
    def tapped_steps(nhid, **plan):
        m, calls = DartsRnnSearch(50, nhid, nhid).train(), []
        cell = m.cell
        m.runner = r = runner_of(ExecutionPlan('cpu', compile=True, **plan), m)   # compiles nothing until called: its functions replaced here
        r.plain = lambda *a: calls.append('plain') or plain_step(cell, *a)
        r.tapped = lambda *a: calls.append('tapped') or tapped_step(cell, *a)
        m.loss(torch.randint(0, 50, (2, 3)), torch.randint(0, 50, (2, 3)))
        return set(calls), 8 * 2 * nhid * nhid >= TAP_MIN_NUMEL   # node 8: its 8 predecessors by its 2·nhid × nhid matrix
    assert tapped_steps(64) == ({'plain'}, False) and tapped_steps(128) == ({'tapped'}, True)
    assert tapped_steps(8, tap_min_numel=0)[0] == {'tapped'}   # rnn-darts check's tiny cells: the paper's graphs
    assert tapped_steps(8)[0] == {'plain'}

def test_a_compiled_steps_tap_gradient_is_one_concatenation(monkeypatch):
    """A tapped compiled step's weights share one tap, split once (`tap_pieces`): in its backward graph the tap's gradient
    is one concatenation of the products' output gradients. Slices of the tap made it a sum of zero-padded gradients
    (`slice_backward`), which Inductor wrote element by element through a mask per weight: 5.9 ms of each backward at
    nhid 300 (0.41 s of a 5.5 s second-order step), against 0.8 ms for the concatenation"""
    from torch._dynamo.backends.common import aot_autograd
    torch._dynamo.reset()
    backwards = []
    keep = lambda gm, _: backwards.append(gm) or gm
    m, x, y = tiny_search()
    m.runner = Compiled(m.cell, tap_min_numel=0, backend=aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=keep))   # taps at this size too
    m.loss(x, y, advance=False).backward()
    tap = [2 * 8, 4 * (1 + PAPER_NODES * (PAPER_NODES + 1) // 2)]   # (out, Σ rows·bs): the state's rows for W0's h part, then each node's stacked predecessors
    made = lambda op: [list(n.meta['val'].shape) for g in backwards for n in g.graph.nodes if n.target == op]
    assert tap in made(torch.ops.aten.cat.default) and tap not in made(torch.ops.aten.slice_backward.default)

@pytest.mark.slow   # two AOT graphs, about 15 s
@pytest.mark.skipif(not kernels.ONEDNN, reason="oneDNN's float32 products do not run here")
def test_a_compiled_pass_multiplies_by_its_own_onednn_copies(monkeypatch):
    """A compiled pass's constant weights (tapped, or wanting no gradient) are multiplied, forward and backward, by the oneDNN
    copies the pass made (`kernels.PackedWeights`), with eager's numbers; the copies live while the pass's graph does, and a
    pass after the weights changed through `.data` (which no version counter sees) makes its own, with an older pass's
    graph still alive"""
    monkeypatch.setattr(kernels, 'KERNEL', 'onednn')
    torch._dynamo.reset()
    found, real = [], kernels._mm_packed
    def spy(a, b, token):
        pw = kernels._PASSES.get(int(token))
        found.append(pw is not None and kernels._where(b) in pw.copies)
        return real(a, b, token)
    monkeypatch.setattr(kernels, '_mm_packed', spy)
    m, x, y = tiny_search(COMPILED_STEPS)
    m.alpha.requires_grad_(True)
    def passes():
        "a pass with weight gradients (tapped), an ∂/∂α-only one, and one without gradients"
        losses = [m.loss(x, y, advance=False, weight_grads=w) for w in (True, False)]
        out = [*torch.autograd.grad(losses[0], [m.alpha, m.cell.block]), *torch.autograd.grad(losses[1], m.alpha)]
        with torch.no_grad(): out.append(m.loss(x, y, advance=False))
        return [*out, *(l.detach() for l in losses)], losses
    tol = dict(rtol=1e-3, atol=1e-5)   # oneDNN's blocked layout against its plain one: another rounding
    with m.frozen_masks():
        eager, _ = passes()
        m.runner = compiled_runner = Compiled(m.cell, tap_min_numel=0, backend=AOT)   # taps at this size too
        compiled, alive = passes()
        for a, b in zip(eager, compiled): torch.testing.assert_close(a, b, **tol)
        gc.collect()   # a first compile's frames, in a cycle, hold the no-gradient pass's step until the collector runs
        assert len(found) > 0 and all(found) and len(kernels._PASSES) == 2   # every product by its pass's copy; the graphs hold theirs
        m.cell.block.data.mul_(1.5)
        m.runner = Eager(); eager, _ = passes()
        m.runner = compiled_runner; found.clear()
        for a, b in zip(eager, passes()[0]): torch.testing.assert_close(a, b, **tol)
        assert all(found)
    del alive; gc.collect()
    assert len(kernels._PASSES) == 0   # the copies die with their graphs

def _mark_accumulators(loss):
    "Tag every gradient accumulator `loss` reaches (a node's metadata lives as long as the node)"
    todo, seen = [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen: continue
        seen.add(fn)
        if type(fn).__name__ == 'AccumulateGrad': fn.metadata['step'] = True
        else: todo += [n for n, _ in fn.next_functions]

def _live_accumulators(m):
    "Parameters whose tagged accumulator is still alive (`view_as` returns the live one, or makes a new one)"
    return [n for n, p in m.named_parameters() if p.requires_grad and p.view_as(p).grad_fn.next_functions[0][0].metadata.get('step')]

@pytest.mark.parametrize('compiled', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_steps_graph_dies_with_its_last_reference(compiled):
    "No reference cycle keeps a step's autograd graph: freed at once, not when Python's collector runs. On CUDA a graph kept alive holds accumulators bound to the eager stream, and capturing the next step fails"
    import gc
    m = DartsRnnSearch(50, 16, 16).train()
    if compiled: m.runner = Compiled(m.cell, backend=AOT)   # the graph's autograd nodes are AOT autograd's, with or without Inductor
    x, y = torch.randint(0, 50, (6, 3)), torch.randint(0, 50, (6, 3))
    gc.disable()
    try:
        loss = m.loss(x, y, advance=False)
        _mark_accumulators(loss)
        assert 'cell.block' in _live_accumulators(m)
        loss.backward(); del loss
        assert _live_accumulators(m) == []
    finally: gc.enable()

# ------------------------------------------------------------------ evaluation stays bounded (issue 22)
def _stream_loss(m, x, bptt=50):
    "Mean eval-mode loss over the stream `x` (bs, n), carried batch to batch as validation does"
    m.eval(); m.reset()
    with torch.no_grad():
        return torch.stack([m.loss(x[:, s:s + bptt], x[:, s + 1:s + 1 + bptt], 'valid') for s in range(0, x.shape[1] - 1, bptt)])

@pytest.mark.slow
@pytest.mark.parametrize('bs', [1, 10])
def test_eval_right_after_init_is_finite_on_a_long_stream(bs, monkeypatch):
    "Running statistics are 0 and 1 at initialisation, so nothing normalises the recurrence; the bound keeps 2,000 tokens finite"
    torch.manual_seed(0)
    m = DartsRnnSearch(500, 16, 16)
    x = torch.randint(0, 500, (bs, 2001))
    losses = _stream_loss(m, x)
    assert torch.isfinite(losses).all() and abs(losses.mean() - math.log(500)) < 1, losses
    import rnn_darts.model as M   # the guard: plain running statistics overflow on the same stream
    monkeypatch.setattr(M, 'bounded_norm', lambda s, mu, var, eps=1e-5: F.batch_norm(s, mu, var, training=False, eps=eps))
    assert not torch.isfinite(_stream_loss(m, x)).all()

def test_bound_is_the_identity_within_training_scale_and_caps_beyond():
    from rnn_darts.model import bounded_norm
    torch.manual_seed(0)
    mu, var = torch.randn(8), torch.rand(8) + 0.5
    s = mu + 0.5 * var.sqrt() * torch.randn(10, 8)                   # mean square of the normalised state ~0.25
    plain = F.batch_norm(s, mu, var, training=False, eps=1e-5)
    assert torch.equal(bounded_norm(s, mu, var), plain)
    z = bounded_norm(mu + 1e6 * torch.randn(10, 8), mu, var)         # far beyond: scaled to mean square 1
    torch.testing.assert_close(z.pow(2).mean(), torch.tensor(1.))

def test_training_and_architecture_passes_never_use_the_bound(monkeypatch):
    "Training-mode forwards (weight steps, architecture passes) normalise with batch statistics only: the bound is for evaluation"
    import rnn_darts.model as M
    def refuse(*a, **k): raise AssertionError('the bound ran in training mode')
    monkeypatch.setattr(M, 'bounded_norm', refuse)
    torch.manual_seed(0)
    m = DartsRnnSearch(50, 8, 8).train()
    x = torch.randint(0, 50, (4, 11))
    m.loss(x[:, :-1], x[:, 1:]).backward()
    m.loss(x[:, :-1], x[:, 1:], 'search', update_stats=False)
    m.eval()
    with pytest.raises(AssertionError, match='the bound ran'): m.loss(x[:, :-1], x[:, 1:], 'valid')

@pytest.mark.parametrize('compiled', [False, True])
def test_alpha_only_passes_make_no_weight_gradient_products(compiled, monkeypatch):
    "loss(weight_grads=False), as the ∂/∂α passes call it: the same ∂/∂α, and about two thirds of the FLOPs (forward and ∂/∂x, no ∂/∂W)"
    from torch.utils.flop_counter import FlopCounterMode
    monkeypatch.setattr(kernels, 'KERNEL', 'aten')   # aten's products, which the FLOP counter sees
    if compiled: torch._dynamo.reset()
    torch.manual_seed(0)
    m = DartsRnnSearch(300, 32, 32, dropouth=0.2, dropoutx=0.2).train()
    if compiled: m.runner = Compiled(m.cell, backend=AOT)   # which gradients the graph computes is AOT autograd's partition
    x, y = torch.randint(0, 300, (8, 12)), torch.randint(0, 300, (8, 12))
    def alpha_grad(weight_grads):
        m.reset()
        with FlopCounterMode(display=False) as fc:
            g = torch.autograd.grad(m.loss(x, y, advance=False, weight_grads=weight_grads), m.alpha)[0]
        return g, fc.get_total_flops()
    with m.frozen_masks():
        alpha_grad(False); alpha_grad(True)   # compiled: both variants traced before counting
        (g0, f0), (g1, f1) = alpha_grad(False), alpha_grad(True)
    torch.testing.assert_close(g0, g1, rtol=1e-5, atol=1e-7)
    if not compiled: assert f0 < 0.75 * f1, (f0, f1)   # a dispatch mode cannot count inside a compiled graph

def test_a_new_way_to_run_is_one_runner_class_and_the_model_holds_no_flag():
    "A runner written outside the project (here: counting time steps) runs a model unchanged and gives eager's loss; `twice_differentiable` swaps the runner and puts it back, even after an error"
    class Counting(Eager):
        def __init__(self): super().__init__(); self.n = 0
        def steps(self, cell, ctx):
            step = super().steps(cell, ctx)
            def counted(*a): self.n += 1; return step(*a)
            return counted
    torch.manual_seed(0)
    m = DartsRnnSearch(30, 8, 8).train()
    x, y = torch.randint(0, 30, (4, 6)), torch.randint(0, 30, (4, 6))
    with m.frozen_masks():
        ref = m.loss(x, y, advance=False)
        m.runner = counting = Counting()
        torch.testing.assert_close(m.loss(x, y, advance=False), ref)
    assert counting.n == 6
    with pytest.raises(RuntimeError, match='inside'), twice_differentiable(m):
        assert m.runner is not counting
        raise RuntimeError('inside')
    assert m.runner is counting
    assert not any(k in vars(m.cell) for k in ('_compiled', '_compiled_tapped', '_fused', 'defer', 'fused_loss')) and 'fused_loss' not in vars(m)
