"""λ_max of ∇²_α L_valid (rnn_darts.callbacks.curvature): equal to the full Hessian's, logged without changing the search; DARTS-ES
stops at the right epoch with the earlier α and weights, and a resume inside its window is exact."""
import io, json, statistics
from contextlib import redirect_stdout
from pathlib import Path
import pytest, torch
from fastai.callback.core import Callback
from rnn_darts import cli
from rnn_darts.model import DartsRnnSearch
from rnn_darts.engine.runners import twice_differentiable
from rnn_darts.callbacks.logs import RunLogger
from rnn_darts.callbacks.curvature import Curvature, CurvatureStop, curvature_batches, hessian_extremes
from tests._learners import tiny_learner

def full_hessian(m, batches, seed=0):
    "∇²_α of the same loss (masks from `seed`, frozen statistics), every row by autograd: the rows of the identity back through ∇_α L, batched (vmap), as a loop of 180 backward passes gives them bit for bit in a tenth of the time"
    with torch.random.fork_rng():
        torch.manual_seed(seed); torch.randn(m.alpha.shape)     # hessian_extremes draws its start vector first
        m.train(); m.alpha.requires_grad_(True)
        with m.frozen_masks(), twice_differentiable(m):
            loss = sum(m.loss(x, y, 'curvature', advance=False, update_stats=False) for x, y in batches) / len(batches)
            g = torch.autograd.grad(loss, m.alpha, create_graph=True)[0].flatten()
            n = g.numel()
            H = torch.autograd.grad(g, m.alpha, torch.eye(n), is_grads_batched=True)[0].reshape(n, n)
        m.alpha.requires_grad_(False)
    return (H + H.t()).double() / 2

# a tiny first-order search with dropout and λ_max, on ~n_train / (8 bptt) batches an epoch
CURVATURE = dict(n_train=600, n_valid=400, n_test=100, eval_bs=4, nhid=12, mode='first', dropout=0.2, dropouth=0.1, dropoutx=0.1, dropouti=0.1,
                 compile=False, curvature=True, checkpoint=True, quiet=False)

@pytest.mark.slow
@pytest.mark.parametrize('trained', [False, True])
def test_lambda_max_is_the_full_hessians(tmp_path, trained):
    "Within 1% of the largest eigenvalue of the full 180 x 180 Hessian (eigvalsh), at initialisation and after a short search"
    learn = tiny_learner(path=tmp_path, **{**CURVATURE, 'curvature': False, 'checkpoint': False})
    if trained:
        with learn.no_bar(), learn.no_logging(): learn.fit(2)
    m = learn.model
    batches = curvature_batches(learn.dls.valid.data.reshape(-1), 4, 6, 1, seed=3)   # small: the full Hessian is 180 backward passes
    lam = hessian_extremes(m, batches)
    ev = torch.linalg.eigvalsh(full_hessian(m, batches))
    assert abs(lam[1].item() - ev[-1].item()) < 0.01 * abs(ev[-1].item()), (lam, ev[[0, -1]])
    assert torch.equal(hessian_extremes(m, batches), lam)             # deterministic

@pytest.mark.slow
def test_logged_every_epoch_without_changing_the_search(tmp_path):
    """lambda_max in log.csv and history.json is the median over the windows at the epoch's end; the search's losses and α are
    those of a search without it. Windows of 5 tokens (`bptt` 5): each window's Lanczos run is most of the time"""
    a = tiny_learner(path=tmp_path/'a', **{**CURVATURE, 'n_train': 300, 'n_valid': 240, 'bptt': 5}, cbs=[RunLogger('log.csv')], curvature_windows=3)
    with a.no_bar(): a.fit(2)
    b = tiny_learner(path=tmp_path/'b', **{**CURVATURE, 'n_train': 300, 'n_valid': 240, 'bptt': 5, 'curvature': False})
    with b.no_bar(): b.fit(2)
    va, vb = a.recorder.values, b.recorder.values
    assert [r[:-1] for r in va] == vb and torch.equal(a.model.alpha, b.model.alpha)   # the measurement forks the RNG
    head, *rows = (tmp_path/'a'/'log.csv').read_text().splitlines()
    assert head.split(',')[-2] == 'lambda_max' and len(rows) == 2
    hist = json.loads((tmp_path/'a'/'history.json').read_text())
    lam = [h['lambda_max'] for h in hist]
    assert lam == [r[-1] for r in va] == a.curvature.values() and all(v > 0 for v in lam)
    m, wins = a.model, a.curvature.batches
    again = [hessian_extremes(m, [b], 8, i)[1].item() for i, b in enumerate(wins)]   # the final weights and α, window i alone, masks from seed i
    assert len(wins) == 3 and hist[-1]['lambda_max_windows'] == pytest.approx(again, rel=1e-6)
    assert lam[-1] == pytest.approx(statistics.median(again), rel=1e-6)
    assert len(set(again)) == 3                                        # three different windows, not one measured thrice

def test_the_median_ignores_one_wild_window(tmp_path):
    "One window whose λ_max is 1,000 times the others' (as PTB gave) moves the median not at all, and a non-finite one makes it NaN"
    learn = tiny_learner(path=tmp_path, **{**CURVATURE, 'n_train': 200, 'n_valid': 100, 'checkpoint': False}, curvature_windows=5)   # the fits only carry the planted values
    curv = learn.curvature
    vals = [[0., 1.], [0., 2.], [0., 3.], [0., 4.], [0., 5.]]
    curv.measure = lambda: torch.tensor(vals)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert curv.value == 3. and curv.per_window == [1., 2., 3., 4., 5.]
    vals[4][1] = 5000.
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert curv.value == 3.
    vals[0][1] = float('nan')
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert curv.value != curv.value
    with pytest.raises(ValueError, match='windows must be a whole number >= 1, got 0'): Curvature(0)

class Planted(Curvature):
    "λ_max read from a planted list instead of measured"
    def __init__(self, values): super().__init__(); self.planted = values
    def after_train(self):
        self.value = self.planted[self.epoch]
        self.history = [h for h in self.history if h['epoch'] < self.epoch] + [dict(epoch=self.epoch, lambda_max=self.value, lambda_min=0.)]

class AlphaLog(Callback):
    "α and the weights at the end of every epoch (before DARTS-ES may restore earlier ones)"
    order = CurvatureStop.order - 1
    def __init__(self): self.alphas, self.weights = {}, {}
    def after_epoch(self): self.alphas[self.epoch], self.weights[self.epoch] = self.model.alpha.detach().clone(), self.model.flat.data.clone()

# flat, then growing: with window 5, delta 4, start 2 the rule fires at epoch 8 (local average 1.8 at epoch 6 against 1 at 2)
PLANTED = [1.] * 8 + [5., 9., 20., 30., 40., 50.]

def es_learner(path, **kw):
    "A search under DARTS-ES with planted λ_max values: 2 training batches an epoch (α moves at each), 3 evaluation batches"
    learn = tiny_learner(path=path, **{**CURVATURE, 'n_train': 160, 'n_valid': 100, 'curvature': False, **kw})
    learn.add_cbs([Planted(PLANTED), CurvatureStop(start=2)])
    return learn

@pytest.fixture(scope='module')
def es_ref(tmp_path_factory):
    "The uninterrupted DARTS-ES search (asked for 12 epochs, it stops at 8), α and the weights of each epoch's end, and what it printed"
    path = tmp_path_factory.mktemp('es')/'ref'
    learn, log, out = es_learner(path), AlphaLog(), io.StringIO()
    with redirect_stdout(out), learn.no_bar(), learn.no_logging(): learn.fit(12, cbs=log)
    return learn, log, out.getvalue(), path

@pytest.mark.slow
def test_early_stop_at_the_right_epoch_keeps_the_earlier_alpha(es_ref):
    learn, log, said, path = es_ref
    assert len(learn.recorder.values) == 9                            # epochs 0..8, then it stopped
    assert "early stop at epoch 8: λ_max's local average rose 1.80× over 4 epochs" in said and 'end of epoch 2' in said
    assert learn.curvature_stop.stopped == dict(epoch=8, restored_epoch=2, ratio=pytest.approx(1.8), window=5, delta=4, factor=1.3)
    assert torch.equal(learn.model.alpha, log.alphas[2]) and torch.equal(learn.model.flat.data, log.weights[2])
    assert not torch.equal(log.alphas[8], log.alphas[2])
    snaps = sorted(p.name for p in (path/'checkpoints').glob('es_epoch_*.pth'))
    assert snaps == [f'es_epoch_{e:04d}.pth' for e in range(2, 9)]     # the window's states only

@pytest.mark.slow
def test_resume_inside_the_window_is_exact(es_ref, tmp_path):
    """Killed (here: a fit of 6 epochs) inside the window, resumed: the same stop, α and weights as the uninterrupted search
    (`es_ref`), so the window's snapshots written before the kill are the ones restored; resuming the stopped run changes
    nothing. (That every other part resumes exactly, λ_max's history included: tests/test_resume.py)"""
    ref = es_ref[0]
    first = es_learner(tmp_path/'run')
    with first.no_bar(), first.no_logging(): first.fit(6)
    resumed = es_learner(tmp_path/'run', resume=True)
    with resumed.no_bar(), resumed.no_logging(): resumed.fit(12)
    assert resumed.curvature_stop.stopped == ref.curvature_stop.stopped
    assert torch.equal(resumed.model.alpha, ref.model.alpha) and torch.equal(resumed.model.flat.data, ref.model.flat.data)
    again = es_learner(tmp_path/'run', resume=True)
    with again.no_bar(), again.no_logging(): again.fit(12)
    assert again.first_epoch == 9 and len(again.recorder.values) == 0
    assert torch.equal(again.model.alpha, ref.model.alpha) and again.model.genotype() == ref.model.genotype()

@pytest.mark.slow
def test_cli_early_stop_flag_and_report(tmp_path):
    "--early-stop true reaches the learner; lambda_max is logged and plotted; run.json records no stop when none happened"
    out = tmp_path/'s'
    learn = cli.run_command(['search', '--data', 'numbers', '--n-train', '600', '--n-eval', '300', '--epochs', '1', '--bs', '8', '--bptt', '10',
                             '--eval-bs', '4', '--emsize', '8', '--nhid', '8', '--device', 'cpu', '--threads', '1', '--mode', 'first',
                             '--early-stop', 'true', '--curvature-windows', '2', '--out', str(out)])
    assert isinstance(learn.curvature_stop, CurvatureStop) and learn.curvature_stop.stopped is None
    info = json.loads((out/'run.json').read_text())
    assert info['settings']['early_stop'] is True and info['early_stop'] is None
    assert 'lambda_max' in (out/'log.csv').read_text().splitlines()[0]
    cli.run_command(['report', str(out)])
    assert (out/'report'/'curvature.png').is_file()
    with pytest.raises(ValueError, match='early_stop true needs curvature true'): tiny_learner(path=tmp_path/'x', **{**CURVATURE, 'curvature': False}, early_stop=True)
