"""Resume is exact, proved once, over the parts: a fit stopped inside its second epoch (as a signal stops it: after a
batch, with a mid-epoch checkpoint) or at an epoch's end (killed before the next batch), then resumed by a new learner
built from the same seed, ends bit for bit as the fit never stopped.

One test, parametrised over every part that keeps state across batches: each α-step mode with its Adam and search
stream, λ_max's history, each method of the DARTS family (τ, β-decay's weight, the Gumbel and Dirichlet draws, SDARTS's
perturbation, whose state is the same for the random and the adversarial kind, DARTS-PT's selection), CUDA graphs'
bookkeeping (`graphs='emulate'`), random search's sampler, and the derived cell's training with NT-ASGD. Each is stopped
inside an epoch (the harder case: hidden states and loader positions too); the first-order search and the training also
at an epoch's end. A fit that resumes bit for bit also repeats bit for bit from its seed: this proves that too. The
sizes are the smallest where a lost state shows: 10 training batches an epoch of a numbers corpus, nhid 8. Processes
killed and resumed through the command line: tests/test_reliability.py (SIGKILL), tests/test_preempt.py (SIGTERM, a
second SIGINT), tests/test_random.py (while scoring) and tests/test_study.py (a study)."""
import signal
import pytest, torch
from fastai.callback.core import Callback
from rnn_darts.callbacks.preemption import Preemption
from tests._learners import tiny_learner

NHID, EPOCHS = 8, 2

RESUME = dict(n_train=800, n_valid=300, n_test=100, eval_bs=8, checkpoint=True)   # 10 training batches an epoch, checkpoints in the run's folder

class StopAt(Callback):
    "Stop the fit after training batch `it` of `epoch`, as SIGINT does (`Preemption` writes the mid-epoch checkpoint); `it=None`: at the epoch's end, before any checkpoint of later epochs"
    order = Preemption.order - 0.5   # after Checkpoint's epoch end, before Preemption's batch end
    def __init__(self, epoch, it=None): self.at = (epoch, it)
    def after_batch(self):
        if self.training and (self.epoch, self.iter) == self.at: self.learn.preemption.signum = signal.SIGINT
    def after_epoch(self):
        if self.at[1] is None and self.epoch == self.at[0]: raise KeyboardInterrupt   # a kill: no callback after it runs

def outcome(learn):
    "Weights, α, buffers, the hidden states the next batch would carry, and each epoch's recorded values"
    m = learn.model
    return ({k: v.detach().clone() for k, v in m.state_dict().items()}, {k: v.clone() for k, v in m.hidden.items()},
            [list(map(float, r)) for r in learn.recorder.values])

def fit(learn, cbs=()):
    with learn.no_logging(): learn.fit(EPOCHS, cbs=list(cbs))

_REFERENCES = {}
def reference(path, kind, kw):
    "The uninterrupted fit's outcome, made once per part: its mid-epoch and epoch-end cases compare with the same one"
    key = (kind, repr(sorted(kw.items())))
    if key not in _REFERENCES:
        ref = tiny_learner(kind, path=path, **RESUME, **kw); fit(ref)
        _REFERENCES[key] = outcome(ref)
    return _REFERENCES[key]

PARTS = [pytest.param('search', dict(mode='first', curvature=True, curvature_windows=2), id='first'),   # λ_max's history too
         pytest.param('search', dict(mode='second', graphs='emulate'), id='second-graphs'),
         *[pytest.param('search', dict(method=m), id=m) for m in ('gdas', 'snas', 'drnas', 'milenas', 'beta-darts', 'sdarts-rs')],
         pytest.param('search', dict(method='darts-pt', pt_tune=2), id='darts-pt'),
         pytest.param('search', dict(mode='random', candidates=4, top=2), id='random'),
         pytest.param('train', dict(asgd=True), id='train-asgd')]
CASES = [pytest.param(*p.values, 'mid-epoch', id=f'{p.id}-mid-epoch') for p in PARTS] + \
        [pytest.param(*p.values, 'epoch-end', id=f'{p.id}-epoch-end') for p in PARTS if p.id in ('first', 'train-asgd')]

@pytest.mark.slow
@pytest.mark.parametrize('kind,kw,stop', CASES)
def test_a_resumed_fit_ends_as_the_uninterrupted_one(kind, kw, stop, tmp_path):
    "Every part's state comes back from a mid-epoch checkpoint (the loaders' positions, hidden states, both optimizers, the callbacks', the RNG states); an epoch's end too, for the search and the training"
    run = tiny_learner(kind, path=tmp_path/'run', **RESUME, **kw)
    if stop == 'mid-epoch':
        fit(run, [StopAt(1, 6)])
        assert run.interrupted and (tmp_path/'run'/'checkpoints'/'mid_epoch.pth').is_file()
    else:
        with pytest.raises(KeyboardInterrupt): fit(run, [StopAt(0)])
    torch.manual_seed(99)   # the checkpoint brings the RNG states back, not the seed
    resumed = tiny_learner(kind, path=tmp_path/'run', resume=True, **RESUME, **kw)
    fit(resumed)
    assert resumed.first_epoch == 1
    (wa, ha, va), (wb, hb, vb) = reference(tmp_path/'ref', kind, kw), outcome(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert ha.keys() == hb.keys() and all(torch.equal(ha[k], hb[k]) for k in ha)
    assert va[1:] == vb and all(torch.isfinite(torch.tensor(r)).all() for r in vb)
