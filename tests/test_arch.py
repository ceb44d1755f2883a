"The architecture step: first/second/exact hypergradients against plain implementations, no crossing gradients, callbacks."
import copy, random, tempfile
import pytest, torch, torch.nn.functional as F
from fastai.learner import Learner
from rnn_darts.core import set_seed
from rnn_darts.model import DartsRnnSearch
from rnn_darts.data import numbers_corpus, lm_dls
from rnn_darts.learner import train_learner, DartsLearner, flat_splitter, evaluate
from rnn_darts.callbacks.arch import ArchParamUpdate, hypergrad_first, hypergrad_second, fd_hvp, exact_hvp
from rnn_darts.callbacks.training import SeqLenLR, FlatGradClip
from rnn_darts.callbacks.asgd import ASGDSwitch
from tests._reference import plain_from, plain_hypergrad_second
from tests._devices import ON_DEVICES
from tests._learners import tiny_learner

NODROP = dict(dropout=0., dropouth=0., dropoutx=0., dropouti=0., dropoute=0.)

def tiny(seed=0, **kw):
    set_seed(seed)
    m = DartsRnnSearch(30, 10, 10, **{**NODROP, **kw}).train()
    trn = (torch.randint(0, 30, (4, 6)), torch.randint(0, 30, (4, 6)))
    val = (torch.randint(0, 30, (4, 6)), torch.randint(0, 30, (4, 6)))
    return m, trn, val

def ce(model, x, y, stream=None):
    "Plain loss from the model's forward on `stream` (fresh hidden state each time)"
    model.reset()
    logits = model(x, stream=stream)[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

def test_first_order_is_grad_of_val_loss():
    m, trn, val = tiny()
    m.alpha.requires_grad_(True)
    m.reset(); g, _ = hypergrad_first(m, trn, val)
    ref = torch.autograd.grad(ce(m, *val, stream='search'), m.alpha)[0]
    torch.testing.assert_close(g, ref)

def test_second_order_equals_plain_implementation():
    m, trn, val = tiny(1)
    m.alpha.requires_grad_(True)
    m.reset(); g, _ = hypergrad_second(m, trn, val, eta=2., wd=1e-3, clip=0.25)
    p = plain_from(m); p.bn_update = False                         # the tests' reference: a fresh model for the unrolled step
    ref = plain_hypergrad_second(p, trn, val, None, None, 2., 1e-3, 0.25)[0]
    torch.testing.assert_close(g, ref, rtol=2e-3, atol=1e-6)

@pytest.mark.parametrize('seed', [0, 1, 2])
def test_finite_differences_agree_with_exact(seed):
    m, trn, val = tiny(seed)
    m.alpha.requires_grad_(True)
    m.reset(); g_fd, _ = hypergrad_second(m, trn, val, 1., 5e-7, 0.25, hvp=fd_hvp)
    m.reset(); g_ex, _ = hypergrad_second(m, trn, val, 1., 5e-7, 0.25, hvp=exact_hvp)
    assert F.cosine_similarity(g_fd.flatten(), g_ex.flatten(), dim=0) >= 0.99

HVPS = dict(first=None, second=fd_hvp, exact=exact_hvp)

@ON_DEVICES
@pytest.mark.parametrize('mode', ['first', 'second', 'exact'])
def test_hypergradients_in_float64_equal_the_cpus(mode, device):
    "In float64, each hypergradient on `device` is the CPU's within 1e-10 (relative): the same math wherever it runs"
    def hypergrad(m, trn, val):
        m.alpha.requires_grad_(True)
        m.reset()
        if mode == 'first': return hypergrad_first(m, trn, val)[0]
        return hypergrad_second(m, trn, val, 2., 1e-3, 0.25, hvp=HVPS[mode])[0]
    m, trn, val = tiny(4)
    m = m.double()
    on = copy.deepcopy(m).to(device)
    ref = hypergrad(m, trn, val)
    got = hypergrad(on, *[tuple(t.to(device) for t in b) for b in (trn, val)])
    assert got.device.type == device and got.dtype == torch.float64 and ref.norm() > 0
    assert ((got.cpu() - ref).norm() / ref.norm()).item() <= 1e-10

SMALL = dict(n_train=400, n_valid=200, n_test=100, bptt=12, nhid=12, quiet=False)   # 5 training batches an epoch (the last a short one), 2 evaluation batches

@pytest.mark.parametrize('mode', ['first', 'second', 'exact'])
def test_arch_step_leaves_weights_bit_identical_and_moves_alpha(mode):
    learn = tiny_learner(mode=mode, **SMALL)
    learn.model.train()
    b = next(iter(learn.dls.train))
    learn.xb, learn.yb, learn.training = (b[0],), (b[1],), True
    learn.create_opt()
    cb = learn.arch_param_update; cb.before_fit()
    w0, a0 = learn.model.flat.data.clone(), learn.model.alpha.detach().clone()
    learn.model.flat.grad.zero_()
    cb.before_batch()
    assert torch.equal(learn.model.flat.data, w0), "weights must be restored bit for bit"
    assert learn.model.flat.grad.abs().sum() == 0, "the architecture step must not leave weight gradients"
    assert not torch.equal(learn.model.alpha, a0) and learn.model.alpha.grad is None

class Spy(ArchParamUpdate.__mro__[1]):   # a plain fastai Callback
    "Records α around the weight step, and α's grad after backward"
    order = 100
    def before_fit(self): self.rec = []
    def after_pred(self): self.a = self.model.alpha.detach().clone()
    def after_backward(self): self.rec.append(('grad', self.model.alpha.grad))
    def after_step(self): self.rec.append(('moved', not torch.equal(self.a, self.model.alpha)))

@pytest.mark.slow
def test_gradients_never_cross():
    learn = tiny_learner(mode='second', **SMALL)
    spy = Spy()
    learn.fit(1, cbs=[spy])
    assert all(g is None for k, g in spy.rec if k == 'grad'), "the weight step must not compute a gradient for α"
    assert not any(m for k, m in spy.rec if k == 'moved'), "the weight step must not move α"

def test_stale_alpha_grad_is_never_read():
    results = []
    for garbage in (False, True):
        learn = tiny_learner(mode='first', **SMALL)
        learn.model.train()
        b = next(iter(learn.dls.train))
        learn.xb, learn.yb, learn.training = (b[0],), (b[1],), True
        learn.create_opt(); learn.arch_param_update.before_fit()
        if garbage: learn.model.alpha.grad = torch.full_like(learn.model.alpha, 1e3)
        learn.arch_param_update.before_batch()
        results.append(learn.model.alpha.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)

def test_no_arch_step_outside_training_or_in_lr_find():
    learn = tiny_learner(mode='first', **SMALL)
    a0 = learn.model.alpha.detach().clone()
    learn.validate()
    assert torch.equal(a0, learn.model.alpha)
    learn.lr_find(num_it=6, show_plot=False)   # more batches than lr_find leaves out at the end (5): it suggests from the rest
    assert torch.equal(a0, learn.model.alpha)

def run_losses(cb_order, seed=0):
    learn = tiny_learner(mode='second', seed=seed, **SMALL); c = learn.dls.corpus
    cbs = [cb for cb in learn.cbs if type(cb).__name__ in ('ArchParamUpdate', 'SeqLenLR', 'FlatGradClip', 'GenotypeLogger')]
    learn.remove_cbs(cbs)
    random.Random(cb_order).shuffle(cbs)
    learn.fit(1, cbs=cbs)
    return [float(v) for v in learn.recorder.values[-1]], learn.model.alpha.detach().clone(), [type(cb).__name__ for cb in cbs]

@pytest.mark.slow
def test_callbacks_work_in_any_order_of_the_list():
    (l1, a1, o1), (l2, a2, o2) = run_losses(0), run_losses(5)
    assert o1 != o2 and l1 == l2 and torch.equal(a1, a2)

def test_the_clip_bounds_a_large_gradient_and_leaves_a_small_one_alone():
    "FlatGradClip against the plain rule g·min(1, c/‖g‖): a planted 'scale every gradient to c' passed the whole suite, as tiny fits' gradients are always above the bound"
    from types import SimpleNamespace
    for scale in (10., 0.01):
        g = torch.randn(50) * scale
        want = g * min(1., 0.25 / (g.norm().item() + 1e-6))
        clip = FlatGradClip(0.25); clip.learn = SimpleNamespace(model=SimpleNamespace(flat=SimpleNamespace(grad=g)))
        clip.before_step()
        torch.testing.assert_close(g, want)

class LrSpy(ArchParamUpdate.__mro__[1]):
    order = 100
    def before_fit(self): self.lrs = []
    def before_step(self): self.lrs.append((self.xb[0].shape[1], self.opt.hypers[0]['lr']))

@pytest.mark.slow
def test_seq_len_scales_learning_rate_and_clip_bounds_norm():
    learn = tiny_learner(mode='first', seed=1, **SMALL)   # seed 1: a half-length batch among the first, and a short last one
    spy = LrSpy()
    learn.fit(1, lr=2., cbs=[spy])
    assert len({sl for sl, _ in spy.lrs}) > 1, "the search policy draws bptt and bptt/2"
    for sl, lr in spy.lrs: assert abs(lr - 2. * sl / 12) < 1e-12
    assert learn.opt.hypers[0]['lr'] == 2.      # restored after the batch
    g = learn.model.flat.grad
    g.normal_(); a_grad = learn.model.alpha.grad
    clip = FlatGradClip(0.25); clip.learn = learn; clip.before_step()
    assert abs(g.norm() - 0.25) < 1e-4 and learn.model.alpha.grad is a_grad

def test_asgd_switch_then_validation_uses_averages():
    set_seed(0)
    c = numbers_corpus(seed=0, n_train=400, n_valid=200, n_test=100)
    dls = lm_dls(c, 8, 12, 'train', seed=0)
    from rnn_darts.genotypes import DARTS_V2
    learn = train_learner(dls, DARTS_V2, emsize=12, nhid=12, asgd=True, checkpoint=False, path=tempfile.mkdtemp())
    learn.fit(1)
    sw = learn.asgd_switch
    assert sw.active and learn.opt.state[learn.model.flat.param]['n_avg'] > 1
    ax = sw.averages()
    assert not torch.equal(ax, learn.model.flat.data)
    raw = learn.model.flat.data.clone()
    got = evaluate(learn, dls.valid)['loss']
    assert torch.equal(raw, learn.model.flat.data), "the raw weights come back after evaluation"
    with torch.no_grad(): learn.model.flat.data.copy_(ax)
    sw2 = learn.asgd_switch; learn.remove_cb(sw2)
    manual = evaluate(learn, dls.valid)['loss']
    learn.add_cb(sw2)
    with torch.no_grad(): learn.model.flat.data.copy_(raw)
    assert abs(got - manual) < 1e-6
    assert abs(evaluate(learn, dls.valid)['loss'] - got) < 1e-6

def bf16_autocast(): return torch.autocast('cpu', dtype=torch.bfloat16)

@pytest.mark.parametrize('mode', ['first', 'second', 'exact'])
def test_arch_passes_stay_fp32_under_bf16_autocast_unless_asked(mode):
    "Under a bf16 autocast, ArchParamUpdate's passes give the fp32 hypergradient bit for bit; arch_bf16=True does not"
    from rnn_darts.engine.bench import arch_updater, arch_hypergrad
    m, trn, val = tiny(3, dropout=0.2, dropouth=0.1)
    def hyper(cb=None):
        m.reset(); torch.manual_seed(0)
        if cb is None: return arch_hypergrad(m, trn, val, mode)
        with bf16_autocast(), cb.precision(): return arch_hypergrad(m, trn, val, mode)
    ref = hyper()
    assert torch.equal(hyper(arch_updater(m, mode)), ref)
    low = hyper(arch_updater(m, mode, arch_bf16=True))
    assert low.dtype == torch.float32 and torch.isfinite(low).all() and not torch.equal(low, ref)

def test_the_finite_difference_stays_fp32_when_the_arch_passes_run_bf16():
    "Second order's ∇²_{α,w}L·v by central differences runs its two passes in float32 inside a bf16 autocast (`arch_bf16`): bit for bit the fp32 one, and the weights restored; in bf16 the difference of the two passes is rounding noise"
    from rnn_darts.callbacks.arch import fd_hvp
    m, trn, val = tiny(3, dropout=0.2, dropouth=0.1)
    v, w0 = torch.randn_like(m.flat.data), m.flat.data.clone()
    m.alpha.requires_grad_(True)
    with m.frozen_masks():
        ref = fd_hvp(m, trn, v, w0)
        with bf16_autocast(): low = fd_hvp(m, trn, v, w0)
    assert torch.equal(low, ref) and torch.equal(m.flat.data, w0)

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['search', 'train'])
def test_learners_with_bf16_train_fp32_weights(kind):
    from rnn_darts.engine.speed import BF16Autocast
    learn = tiny_learner(kind, precision='bf16', **({'mode': 'second'} if kind == 'search' else {}), **SMALL)
    assert any(isinstance(cb, BF16Autocast) for cb in learn.cbs)
    w0 = learn.model.flat.data.clone()
    learn.fit(1)
    assert learn.model.flat.data.dtype == torch.float32 and not torch.equal(w0, learn.model.flat.data)
    assert all(v == v for v in learn.recorder.values[-1]), "losses and metrics are finite numbers"
    if kind == 'search': assert learn.model.alpha.dtype == torch.float32

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['search', 'train'])
def test_fused_decoder_loss_trains_like_the_plain_loss(kind):
    "FusedDecoderLoss (the default) and the plain decoder + cross-entropy train alike: losses, weights (and α)"
    from rnn_darts.engine.speed import FusedDecoderLoss
    def run(fused):
        learn = tiny_learner(kind, fused_loss=fused, **({'mode': 'second'} if kind == 'search' else {}), **SMALL)
        assert any(isinstance(cb, FusedDecoderLoss) for cb in learn.cbs) == fused and learn.model.runner.fused_loss == fused
        learn.fit(1)
        return torch.tensor(learn.recorder.losses), learn.model.flat.data.clone()
    (l1, w1), (l2, w2) = run(True), run(False)
    if kind == 'search':   # Adam on α's small gradients turns float rounding into sign flips after a few steps
        torch.testing.assert_close(l1[:3], l2[:3], rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5); torch.testing.assert_close(w1, w2, rtol=1e-3, atol=5e-5)
