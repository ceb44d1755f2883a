"The architecture step as users run it: `ArchParamUpdate` inside a real fastai `Learner` (`search_learner`, `fit`)."
import pytest, torch, torch.nn.functional as F
from fastai.callback.core import Callback, CancelFitException
from rnn_darts.genotypes import PRIMITIVES
from rnn_darts.callbacks.arch import ArchParamUpdate, op_decay_grad
from rnn_darts.engine.bench import arch_updater
from tests._learners import tiny_learner

NHID = 8

def fit(learn, *cbs):
    with learn.no_logging(): learn.fit(1, cbs=list(cbs))

class Around:
    "Snapshots of α and the BatchNorm statistics just before and just after `ArchParamUpdate.before_batch`; optional stop"
    def __init__(self, stop_after=None): self.snaps, self.stop_after = [], stop_after
    @staticmethod
    def snap(m):
        return dict(alpha=m.alpha.detach().clone(), w=m.flat.data.clone(),
                    bn={k: v.clone() for k, v in m.cell.bn.state_dict().items()})
    def cbs(self):
        outer = self
        class Before(Callback):
            order = ArchParamUpdate.order - 0.5
            def before_batch(self):
                if self.training: outer.snaps.append([outer.snap(self.model)])
        class After(Callback):
            order = ArchParamUpdate.order + 0.5
            def before_batch(self):
                if not self.training: return
                outer.snaps[-1].append(outer.snap(self.model))
                if outer.stop_after and len(outer.snaps) >= outer.stop_after: raise CancelFitException()
        return [Before(), After()]

# ------------------------------------------------------------------ BatchNorm statistics frozen (update_stats=False)
@pytest.mark.slow
@pytest.mark.parametrize('mode', ['first', 'second'])
def test_arch_step_changes_alpha_only_never_the_bn_statistics_or_weights(mode):
    learn = tiny_learner(mode=mode)
    rec = Around()
    fit(learn, *rec.cbs())
    assert len(rec.snaps) > 10
    for before, after in rec.snaps:
        for k in before['bn']: assert torch.equal(before['bn'][k], after['bn'][k]), k
        assert torch.equal(before['w'], after['w'])
        assert not torch.equal(before['alpha'], after['alpha'])
    # while the weight steps do move the statistics, node by node
    assert not torch.equal(rec.snaps[0][1]['bn']['running_mean'], rec.snaps[-1][0]['bn']['running_mean'])

# ------------------------------------------------------------------ same_masks
class MaskSpy(Callback):
    "The input-dropout masks (`x`) each architecture pass of the first step draws, per stream"
    order = ArchParamUpdate.order - 0.5
    def before_fit(self):
        cell, self.seen, self.arch = self.model.cell, [], False
        forward, masks = cell.forward, cell.masks
        def spy_forward(*a, **k):
            self.arch = k.get('update_stats') is False   # an architecture pass runs the cell with update_stats=False
            return forward(*a, **k)
        def spy_masks(bank, key, bs, like):
            mx, mh = masks(bank, key, bs, like)
            if self.arch: self.seen.append((key, mx.clone(), mh.clone()))
            return mx, mh
        cell.forward, cell.masks = spy_forward, spy_masks
    def after_batch(self): raise CancelFitException()

@pytest.mark.parametrize('same', [True, False])
def test_same_masks_decides_whether_the_passes_share_masks(same):
    learn = tiny_learner(mode='second', same_masks=same, dropoutx=0.5, dropouth=0.5)
    spy = MaskSpy()
    fit(learn, spy)
    train = [(mx, mh) for key, mx, mh in spy.seen if key == 'train']
    assert len(train) == 3                          # L_t at w, w + εv, w − εv
    shared = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(train, train[1:]))
    assert shared == same

# ------------------------------------------------------------------ the zero-one (Fair DARTS) loss
def test_zero_one_gradient_is_that_of_the_fair_darts_loss_with_its_sign():
    "`--method fair-darts` (Chu et al., ECCV 2020): sigmoid weights, first order, and its code's zero-one loss weight, 10"
    w = 10.
    learn = tiny_learner(method='fair-darts')
    assert (learn.model.relax, learn.arch_param_update.mode) == ('sigmoid', 'first')
    rec = {}
    class Spy(Callback):
        order = ArchParamUpdate.order + 0.5
        def before_fit(self):
            arch = self.learn.arch_param_update
            def reduce(g):
                rec['hyper'], rec['alpha'] = g.clone(), self.model.alpha.detach().clone(); return g
            arch.reduce = reduce
            step = arch.arch_opt.step
            def spy_step(*a, **k):
                rec['adam_grad'] = self.model.alpha.grad.clone(); return step(*a, **k)
            arch.arch_opt.step = spy_step
        def before_batch(self): raise CancelFitException()
    fit(learn, Spy())
    a = rec['alpha'].requires_grad_()
    l01 = -w * ((torch.sigmoid(a) - 0.5) ** 2).mean()          # Fair DARTS: push σ(α) away from ½
    ref = torch.autograd.grad(l01, a)[0]
    torch.testing.assert_close(rec['adam_grad'] - rec['hyper'], ref, rtol=1e-5, atol=1e-9)
    # descending it moves every σ(α) away from ½
    assert (torch.sign(-ref) == torch.sign(rec['alpha'])).float().mean() == 1

def test_zero_one_with_softmax_is_an_error():
    with pytest.raises(ValueError, match=r"zero_one \(Fair DARTS's zero-one loss weight\) has an effect only with relax sigmoid, and relax is softmax"):
        fit(tiny_learner(mode='first', zero_one=0.1))
    from rnn_darts.model import DartsRnnSearch
    with pytest.raises(ValueError, match='zero_one'): arch_updater(DartsRnnSearch(20, 6, 6), 'first', zero_one=0.1)

# ------------------------------------------------------------------ op decay ∝ parameter count
def test_op_decay_gradient_is_that_of_the_count_weighted_penalty():
    from rnn_darts.model import DartsRnnSearch
    m = DartsRnnSearch(20, 6, 6)
    n = [0 if op == 'none' else 2 * 6 * 6 + 1 for op in PRIMITIVES]    # weights of W_i used by the op, +1 (AutoRA)
    a = m.alpha.detach().clone().requires_grad_()
    ref = torch.autograd.grad(1e-3 * (a * torch.tensor(n, dtype=a.dtype)).sum(), a)[0]
    torch.testing.assert_close(op_decay_grad(m, 1e-3), ref)
    assert (op_decay_grad(m, 1e-3)[:, PRIMITIVES.index('none')] == 0).all()

def test_op_decay_reaches_the_callback_from_search_learner_and_spares_none():
    d, lr = 1e-3, 3e-3
    alphas = []
    for decay in (0., d):
        learn = tiny_learner(mode='first', op_decay=decay, arch_lr=lr)
        assert learn.arch_param_update.op_decay == decay
        rec = Around(stop_after=1)
        fit(learn, *rec.cbs())
        alphas.append(rec.snaps[0][1]['alpha'])
    diff = alphas[1] - alphas[0]
    none = PRIMITIVES.index('none')
    assert torch.equal(diff[:, none], torch.zeros_like(diff[:, none]))
    others = [k for k in range(len(PRIMITIVES)) if k != none]
    torch.testing.assert_close(diff[:, others], torch.full_like(diff[:, others], -lr * d * (2 * NHID * NHID + 1)), rtol=1e-4, atol=1e-7)

# ------------------------------------------------------------------ the guard
def test_a_non_finite_hypergradient_moves_nothing_even_at_the_first_step():
    learn = tiny_learner(mode='first')
    rec = Around(stop_after=2)
    calls = []
    class Poison(Callback):
        order = ArchParamUpdate.order - 0.5
        def before_fit(self):
            self.learn.arch_param_update.reduce = lambda g: (calls.append(1), g * float('nan') if len(calls) == 1 else g)[1]
    fit(learn, Poison(), *rec.cbs())
    arch = learn.arch_param_update
    (b0, a0), (b1, a1) = rec.snaps
    assert torch.equal(b0['alpha'], a0['alpha'])           # the poisoned first step did not move α
    assert not torch.equal(b1['alpha'], a1['alpha'])       # the next one did
    assert int(arch.n_skipped) == 1
    assert arch.arch_opt.state[learn.model.alpha]['step'].item() == 1   # Adam counted only the finite step

def test_a_hypergradient_that_overflows_adams_second_moment_moves_nothing():
    "A finite but huge hypergradient overflows exp_avg_sq (then α would stall for good): the step is skipped, the next one moves α"
    learn = tiny_learner(mode='first')
    rec, calls = Around(stop_after=3), []
    class Huge(Callback):
        order = ArchParamUpdate.order - 0.5
        def before_fit(self):
            self.learn.arch_param_update.reduce = lambda g: (calls.append(1), g / g.abs().max() * 1e25 if len(calls) == 2 else g)[1]
    fit(learn, Huge(), *rec.cbs())
    arch = learn.arch_param_update
    st = arch.arch_opt.state[learn.model.alpha]
    (b0, a0), (b1, a1), (b2, a2) = rec.snaps
    assert torch.equal(b1['alpha'], a1['alpha']) and not torch.equal(b2['alpha'], a2['alpha'])
    assert int(arch.n_skipped) == 1 and st['step'].item() == 2 and all(torch.isfinite(v).all() for v in st.values())
