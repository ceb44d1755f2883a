"""The architecture step of a real `search_learner` fit against a plain reference, batch by batch.

For every training batch the test snapshots the model just before the batch's callbacks run, and records the search
batch the architecture step drew, the gradient Adam was handed and α just after. It then recomputes, independently:
- the hypergradient the paper's way (`PlainSearchRnn`: per-edge, per-op, a fresh model for the unrolled step), with
  the virtual step's learning rate η = lr · seq_len / bptt (the batch's, as `SeqLenLR` scales it), the weights' clip
  and weight decay;
- Adam's update of α, written out here with its L2 weight decay.
Each of these wrong changes fails a test below: the architecture step ordered before `SeqLenLR` (η unscaled), the
virtual step taking `arch_lr` instead of the weights' learning rate, α's hypergradient clipped before Adam, a Adam
without its weight decay; and a derived genotype that keeps `none`."""
import json, math
from pathlib import Path
import pytest, torch
from fastai.callback.core import Callback, CancelFitException
from rnn_darts.genotypes import PRIMITIVES, PAPER_NODES, edge_slices
from tests._reference import plain_from, plain_hypergrad_first, plain_hypergrad_second
from tests._learners import tiny_learner, NODROP

# the weights' steps are clipped to lr · clip = 5 as with the paper's lr 20 and clip 0.25, but α's hypergradient (~1e-2) is
# above the clip: clipping it before Adam would change it (see the guard)
BPTT, LR, WD, CLIP, ARCH_LR, ARCH_WD = 10, 5000., 5e-7, 1e-3, 3e-3, 1e-3
# 8 wide, training-phase batch lengths around bptt (std 5): η = lr · seq_len / bptt varies batch to batch
REFERENCE = dict(n_train=3000, phase='train', bptt=BPTT, lr=LR, wd=WD, clip=CLIP, arch_lr=ARCH_LR, arch_wd=ARCH_WD, **NODROP)

class Recorder:
    "Per training batch: the model's state before any callback acts, the search batch, Adam's gradient and α after"
    def __init__(self, n_batches): self.steps, self.n = [], n_batches
    def cbs(self):
        rec = self
        class First(Callback):
            order = -1000   # before every callback, wherever ArchParamUpdate is put
            def before_fit(self):
                arch = self.learn.arch_param_update
                nxt, step = arch.search_dl.next, arch.arch_opt.step if arch.arch_opt else None
                def next_(n):
                    b = nxt(n); rec.steps[-1]['val'] = tuple(t.clone() for t in b); return b
                arch.search_dl.next = next_
                def spy_step(*a, **k):
                    rec.steps[-1]['adam_grad'] = self.model.alpha.grad.clone(); return spy_step.orig(*a, **k)
                rec.spy_step = spy_step
            def before_batch(self):
                if not self.training: return
                opt = self.learn.arch_param_update.arch_opt
                if getattr(opt.step, '__name__', '') != 'spy_step': rec.spy_step.orig, opt.step = opt.step, rec.spy_step
                m = self.model
                rec.steps.append(dict(plain=plain_from(m), alpha=m.alpha.detach().clone(), trn=(self.xb[0].clone(), self.yb[0].clone()),
                                      h_trn=m.hidden.get('train'), h_val=m.hidden.get('search')))
        class Last(Callback):
            order = 1000    # after every callback's before_batch: the architecture step is done
            def before_batch(self):
                if not self.training: return
                rec.steps[-1]['alpha_after'] = self.model.alpha.detach().clone()
                if len(rec.steps) >= rec.n: raise CancelFitException()
        return [First(), Last()]

def record(learn, n=6):
    rec = Recorder(n)
    with learn.no_logging(): learn.fit(1, cbs=rec.cbs())
    assert len(rec.steps) == n and all('alpha_after' in s and 'adam_grad' in s for s in rec.steps)
    return rec.steps

def reference_hypergrad(s, mode):
    "The paper's hypergradient at the recorded state, η = lr · seq_len / bptt; the architecture pass: batch statistics, not updated"
    p = s['plain'].train()
    p.bn_update = False
    p.alpha.requires_grad_(True)
    if mode == 'first': return plain_hypergrad_first(p, s['val'], s['h_val'])[0]
    eta = LR * s['trn'][0].shape[1] / BPTT
    return plain_hypergrad_second(p, s['trn'], s['val'], s['h_trn'], s['h_val'], eta, WD, CLIP)[0]

def reference_adam(steps, grads, lr=ARCH_LR, wd=ARCH_WD, betas=(0.9, 0.999), eps=1e-8):
    "α after each step, from the recorded α before it: Adam with L2 weight decay (`torch.optim.Adam`'s `weight_decay`), written out"
    m = v = 0
    out = []
    for k, (s, g) in enumerate(zip(steps, grads), 1):
        a = s['alpha']
        g = g + wd * a
        m, v = betas[0] * m + (1 - betas[0]) * g, betas[1] * v + (1 - betas[1]) * g * g
        out.append(a - lr * (m / (1 - betas[0] ** k)) / ((v / (1 - betas[1] ** k)).sqrt() + eps))
    return out

@pytest.mark.parametrize('mode', ['first', 'second'])
def test_alpha_steps_of_a_fit_equal_the_reference(mode):
    steps = record(tiny_learner(mode=mode, **REFERENCE))
    lens = {s['trn'][0].shape[1] for s in steps}
    assert len(lens) > 1, f"the test needs batches of different lengths (η = lr · seq_len / bptt): {lens}"
    grads = [reference_hypergrad(s, mode) for s in steps]
    for k, (s, g) in enumerate(zip(steps, grads)):   # what Adam is handed: the hypergradient, unclipped, unscaled
        torch.testing.assert_close(s['adam_grad'], g, rtol=5e-3, atol=1e-6, msg=lambda m: f"batch {k} (seq_len {s['trn'][0].shape[1]}): {m}")
    for k, (s, want) in enumerate(zip(steps, reference_adam(steps, [s['adam_grad'] for s in steps]))):   # Adam's update
        torch.testing.assert_close(s['alpha_after'], want, rtol=1e-5, atol=1e-7, msg=lambda m: f"batch {k}: {m}")

@pytest.mark.slow
def test_second_order_term_is_large_enough_to_tell_eta_apart():
    "Guard of the test above: with η from `arch_lr`, or unscaled by seq_len, the reference hypergradient differs well beyond its tolerance"
    steps = record(tiny_learner(mode='second', **REFERENCE), n=2)
    assert {s['trn'][0].shape[1] for s in steps} - {BPTT}, "the guard needs a batch whose η is scaled by seq_len / bptt"
    for s in steps:
        T = s['trn'][0].shape[1]
        right = reference_hypergrad(s, 'second')
        for eta in ({LR, ARCH_LR} if T == BPTT else {LR, ARCH_LR, LR * T / BPTT * 1.5}) - {LR * T / BPTT}:
            p = s['plain']; p.alpha.requires_grad_(True)
            wrong = plain_hypergrad_second(p, s['trn'], s['val'], s['h_trn'], s['h_val'], eta, WD, CLIP)[0]
            assert (wrong - right).norm() > 0.05 * right.norm(), (T, eta)

def test_adam_sees_gradients_larger_than_the_clip():
    "Guard: α's hypergradient exceeds the weights' clip norm here, so clipping it before Adam would change what Adam sees"
    steps = record(tiny_learner(mode='second', **REFERENCE), n=3)
    assert all(s['adam_grad'].norm() > CLIP for s in steps), [float(s['adam_grad'].norm()) for s in steps]

def reference_genotype(weights):
    "The DARTS rule, written out: per node, among its incoming edges the one whose best non-`none` op weighs most, and that op"
    rec = []
    for i, sl in enumerate(edge_slices(PAPER_NODES), 1):
        best = max(((w, j, k) for j, row in enumerate(weights[sl]) for k, w in enumerate(row) if PRIMITIVES[k] != 'none'))
        rec.append([PRIMITIVES[best[2]], best[1]])
    return rec

@pytest.mark.slow
def test_derived_genotype_never_has_none_even_when_none_dominates(tmp_path):
    learn = tiny_learner(path=tmp_path, **{**REFERENCE, 'mode': 'first', 'arch_lr': 1e-4, 'n_train': 400})   # 2 epochs of 5 batches
    with torch.no_grad(): learn.model.alpha[:, PRIMITIVES.index('none')] = 5.   # `none` wins every edge by far
    with learn.no_logging(): learn.fit(2)
    hist = json.loads((tmp_path/'history.json').read_text())
    assert len(hist) == 2
    for h in hist:
        w = torch.tensor(h['weights'])
        assert (w.argmax(1) == PRIMITIVES.index('none')).all()       # the premise: `none` is every edge's heaviest op
        assert h['genotype']['recurrent'] == reference_genotype(h['weights'])
        assert all(op != 'none' for op, _ in h['genotype']['recurrent'])
    assert [list(x) for x in learn.model.genotype().recurrent] == reference_genotype(learn.model.arch_weights().tolist())
