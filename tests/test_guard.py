"""Divergence never poisons what is kept; checkpoint rotation and temporary files (issue 13, issue 15's rollback).

Real learners on the tiny corpus of tests/test_reliability.py; NaN/inf injected by callbacks at a chosen batch.
"""
import os, subprocess, sys
import pytest, torch
from fastai.callback.core import Callback
from rnn_darts.callbacks.checkpoint import Checkpoint, load_checkpoint, restore, kept_nonfinite, save_atomic
from tests._resume_script import build
from tests.test_reliability import fit, sd_clone, sd_equal, tiny_train, safe_tar, Inject, SetValid

NAN, INF = float('nan'), float('inf')

def first_float_buffer(model):
    "Name and tensor of the model's first floating buffer (normalisation statistics), whatever the model calls them"
    return next((n, b) for n, b in model.named_buffers() if b.is_floating_point())

TARGETS = {   # what to poison -> (the tensor, the name `kept_nonfinite` / the guard give it)
    'buffer': lambda l: (first_float_buffer(l.model)[1], 'model.' + first_float_buffer(l.model)[0]),
    'weight': lambda l: (l.model.encoder.weight.data, 'model.encoder.weight'),
    'alpha': lambda l: (l.model.alpha.data, 'model.alpha'),
    'arch_adam': lambda l: (l.arch_param_update.arch_opt.state[l.model.alpha]['exp_avg_sq'], 'cbs.ArchParamUpdate.arch_opt.state.0.exp_avg_sq'),
    'asgd_ax': lambda l: (l.opt.state[l.model.flat.param]['ax'], 'opt.state[0].ax'),
}

class Poison(Callback):
    "After the step (and the guard's restore) at (epoch, iter): write `value` into one number of a state tensor"
    order = 13
    def __init__(self, at, target, value=NAN): self.at, self.target, self.value = at, target, value
    def after_step(self):
        if (self.epoch, self.iter) != self.at: return
        t, self.what = TARGETS[self.target](self.learn)
        with torch.no_grad(): t.view(-1)[0] = self.value

class Snap(Callback):
    "The model, α's Adam state and the weight optimizer's state at after_train, at this callback's order"
    def __init__(self, order): self.order, self.at = order, {}
    def after_train(self):
        arch = getattr(self.learn, 'arch_param_update', None)
        adam = {k: v.clone() for k, v in arch.arch_opt.state[self.model.alpha].items()} if arch else None
        self.at[self.epoch] = dict(model=sd_clone(self.model), adam=adam)

def files(path): return sorted(os.listdir(path/'checkpoints'))

# ---------------------------------------------------------------- a non-finite validation loss is never best
@pytest.mark.parametrize('v', [INF, NAN])
def test_nonfinite_valid_loss_is_never_best(tmp_path, v):
    learn = tiny_train(tmp_path, cbs=[SetValid(1, v), SetValid(0, 99.)]); fit(learn, 2)
    assert files(tmp_path) == ['best.pth', 'epoch_0000.pth', 'epoch_0001.pth']
    assert load_checkpoint(tmp_path/'checkpoints'/'best.pth')['epoch'] == 0   # not epoch 1 (old code: `v == v` let inf in)
    assert learn.checkpoint.best == 99.

# ---------------------------------------------------------------- a run that never validated finitely ends as a failure
class AllValid(SetValid):
    "Every epoch's validation loss is `v`"
    def __init__(self, v): super().__init__(None, v)
    def after_epoch(self):
        if self.training is False: self.learn.final_record[1] = self.v

@pytest.mark.slow
@pytest.mark.parametrize('on_nan', ['skip', 'rollback', 'stop'])
@pytest.mark.parametrize('v', [NAN, 1e28])   # 1e28: a number, but its perplexity is not
def test_a_run_that_never_validated_finitely_stops(tmp_path, on_nan, v):
    "In every on_nan mode, learn.fit raises at the first epoch's end; the epoch is logged, no checkpoint of it is kept"
    learn = tiny_train(tmp_path, on_nan=on_nan, cbs=[AllValid(v)])
    with pytest.raises(RuntimeError, match=r"epoch 0: the validation loss is (nan|1e\+28), and no epoch of this run had a finite validation loss "
                                           r"and perplexity.*; stopping. Try a smaller learning rate \(--lr\)"): fit(learn, 3)
    assert len(learn.recorder.values) == 1 and not (tmp_path/'checkpoints').exists()

@pytest.mark.slow
def test_a_run_that_validated_finitely_once_goes_on_and_names_that_epoch(tmp_path, capsys):
    "Finite at epoch 0 only: on_nan='skip' trains on, the end says which epoch last validated finitely; a resume remembers it"
    learn = tiny_train(tmp_path, on_nan='skip', cbs=[SetValid(1, NAN), SetValid(2, NAN)]); fit(learn, 3)
    assert "the validation perplexity was last finite at epoch 0; the epochs after it, to epoch 2, were not" in capsys.readouterr().out
    resumed = tiny_train(tmp_path, on_nan='skip', resume=True, cbs=[AllValid(NAN)]); fit(resumed, 4)   # epoch 3 is not finite either
    assert resumed.first_epoch == 3 and "last finite at epoch 0; the epochs after it, to epoch 3, were not" in capsys.readouterr().out
    p = tmp_path/'checkpoints'/'epoch_0003.pth'
    old = load_checkpoint(p); del old['cbs']['FiniteValidation']; save_atomic(old, p)   # as a version before FiniteValidation wrote it
    older = tiny_train(tmp_path, on_nan='skip', resume=True, cbs=[AllValid(NAN)]); fit(older, 5)   # its finite best says enough
    assert older.first_epoch == 4 and older.finite_validation.last_finite is None

def test_minus_inf_valid_loss_is_never_best(tmp_path):
    learn = tiny_train(tmp_path, cbs=[SetValid(1, -INF)]); fit(learn, 3)
    valid = [r[1] for r in learn.recorder.values]
    best = load_checkpoint(tmp_path/'checkpoints'/'best.pth')
    assert valid[1] == -INF and best['epoch'] != 1
    assert best['cbs']['BestValidLoss']['best'] == min(valid[0], valid[2]) == learn.checkpoint.best == learn.best_valid_loss.value

def test_one_tracker_of_the_best_validation_loss(tmp_path):
    "run.json, Checkpoint and best.pth all read BestValidLoss; validate() leaves it alone; a resume keeps it, from an older checkpoint too"
    import json
    from rnn_darts.learner import RunInfo
    learn = tiny_train(tmp_path, cbs=[SetValid(1, 0.5), RunInfo('train')]); fit(learn, 3)
    valid = [r[1] for r in learn.recorder.values]
    assert valid[1] == 0.5 == learn.best_valid_loss.value == learn.checkpoint.best == json.loads((tmp_path/'run.json').read_text())['best_valid_loss']
    assert load_checkpoint(tmp_path/'checkpoints'/'best.pth')['epoch'] == 1
    learn.validate(); assert learn.best_valid_loss.value == 0.5
    p = tmp_path/'checkpoints'/'epoch_0002.pth'
    old = load_checkpoint(p); old['cbs']['Checkpoint']['best'] = old['cbs'].pop('BestValidLoss')['best']; save_atomic(old, p)   # as an older version wrote it
    resumed = tiny_train(tmp_path, resume=True); fit(resumed, 4)
    assert resumed.first_epoch == 3 and resumed.best_valid_loss.value == 0.5            # epoch 3's own loss is far above 0.5
    bare = tiny_train(tmp_path/'x'); bare.remove_cb(bare.best_valid_loss)
    with pytest.raises(ValueError, match='(Checkpoint|RunInfo) reads the best validation loss from the BestValidLoss callback'): fit(bare, 1)

# ---------------------------------------------------------------- no checkpoint is written with a non-finite state
@pytest.mark.slow
@pytest.mark.parametrize('target', ['buffer', 'weight', 'alpha', 'arch_adam', 'asgd_ax'])
def test_checkpoint_refuses_nonfinite_state(tmp_path, capsys, target):
    "on_nan='skip' goes on with a poisoned state: the writer keeps the previous checkpoints and says what was not finite"
    poison = Poison((1, 2), target, INF if target == 'asgd_ax' else NAN)
    if target == 'asgd_ax': learn = tiny_train(tmp_path, asgd=True, on_nan='skip', cbs=[poison])
    else: learn = safe_tar(build(tmp_path, 0, on_nan='skip', cbs=[poison]))
    fit(learn, 2)
    out = capsys.readouterr().out
    assert files(tmp_path) == ['best.pth', 'epoch_0000.pth']
    assert load_checkpoint(tmp_path/'checkpoints'/'best.pth')['epoch'] == 0
    assert kept_nonfinite(load_checkpoint(tmp_path/'checkpoints'/'epoch_0000.pth')) == []
    line = next(l for l in out.splitlines() if l.startswith('epoch 1: no checkpoint written: non-finite values in '))
    assert poison.what in line and line.endswith('; the previous checkpoints are kept')
    assert learn.checkpoint.written == ['epoch_0000.pth']
    ev = learn.divergence_guard.events    # the guard's end-of-epoch check saw it too (model, both optimizers)
    assert ev[-1]['epoch'] == 1 and poison.what in ev[-1]['nonfinite'] and ev[-1]['action'] == 'skip'

# ---------------------------------------------------------------- the guard checks the state once per epoch
@pytest.mark.slow
def test_guard_rolls_back_nonfinite_buffers(tmp_path, capsys):
    "Normalisation statistics poisoned with no skipped step: the end-of-epoch check rolls the model back to the checkpoint"
    learn = safe_tar(build(tmp_path, 0, on_nan='rollback', cbs=[Poison((1, 2), 'buffer', INF), snap := Snap(13)]))
    fit(learn, 2)
    ck = load_checkpoint(tmp_path/'checkpoints'/'epoch_0000.pth')
    name = 'model.' + first_float_buffer(learn.model)[0]
    ev = learn.divergence_guard.events
    assert ev == [dict(epoch=1, skipped=dict(weight=0, architecture=0), nonfinite=[name], action='rollback')]
    assert sd_equal(snap.at[1]['model'], ck['model'])
    out = capsys.readouterr().out
    assert f"epoch 1: the state after the epoch's steps is not finite in {name}" in out
    assert f"rolled back the model and the optimizers to {tmp_path/'checkpoints'/'epoch_0000.pth'}" in out

def test_guard_stops_on_nonfinite_state(tmp_path):
    learn = safe_tar(build(tmp_path, 0, on_nan='stop', cbs=[Poison((0, 2), 'buffer', NAN)]))
    name = 'model.' + first_float_buffer(learn.model)[0]
    with pytest.raises(RuntimeError, match=rf"(^|\t)epoch 0: the state after the epoch's steps is not finite in {name}; stopping \(on_nan='stop'\)"):
        fit(learn, 1)

@pytest.mark.slow
def test_rollback_without_a_finite_checkpoint_stops(tmp_path, capsys):
    "No checkpoint yet, or only a non-finite one (as an older version could write): a clear error, not a poisoned run"
    ck = tmp_path/'checkpoints'
    learn = safe_tar(build(tmp_path, 0, on_nan='rollback', cbs=[Poison((0, 2), 'weight', NAN)]))
    with pytest.raises(RuntimeError, match=rf"(^|\t)no finite checkpoint to roll back to in {ck}, and the state after epoch 0 is not "
                                           r"finite \(.*model\.encoder\.weight.*\); stopping \(on_nan='rollback'\)"):
        fit(learn, 1)
    learn = safe_tar(build(tmp_path/'b', 0, on_nan='rollback', cbs=[Poison((1, 2), 'buffer', NAN)]))
    fit(learn, 1)
    p = tmp_path/'b'/'checkpoints'/'epoch_0000.pth'
    st = load_checkpoint(p); st['model']['alpha'][0, 0] = NAN; save_atomic(st, p)
    with pytest.raises(RuntimeError, match=r"(^|\t)no finite checkpoint to roll back to"): fit(learn, 2, start_epoch=1)
    assert f"not rolling back to {p}: non-finite values in model.alpha" in capsys.readouterr().out

@pytest.mark.slow
def test_rollback_with_only_skipped_steps_and_no_checkpoint_goes_on(tmp_path, capsys):
    learn = safe_tar(build(tmp_path, 0, on_nan='rollback', checkpoint=False, cbs=[Inject(at=(0, 3), grad=True)]))
    fit(learn, 1)
    assert "no checkpoint to roll back to (this learner has no Checkpoint callback): continuing from the last finite weights" in capsys.readouterr().out
    assert torch.isfinite(learn.model.flat.data).all()

# ---------------------------------------------------------------- a rollback restores α's Adam state exactly
@pytest.mark.slow
def test_rollback_restores_alpha_adam_state_exactly(tmp_path):
    "Weights, α, statistics and α's Adam state (exp_avg, exp_avg_sq, step) equal the checkpoint's after a rollback"
    before, after = Snap(11.9), Snap(12.1)        # around the guard's after_train (order 12)
    learn = safe_tar(build(tmp_path, 0, on_nan='rollback', cbs=[Inject(at=(1, 3), grad=True), before, after]))
    fit(learn, 2)
    ck = load_checkpoint(tmp_path/'checkpoints'/'epoch_0000.pth')
    saved = ck['cbs']['ArchParamUpdate']['arch_opt']['state'][0]
    assert set(saved) == {'step', 'exp_avg', 'exp_avg_sq'}
    for k in saved:
        assert not torch.equal(before.at[1]['adam'][k], saved[k])   # epoch 1 moved it: a rollback that skips it is seen
        assert torch.equal(after.at[1]['adam'][k], saved[k]), k
    assert sd_equal(after.at[1]['model'], ck['model']) and not sd_equal(before.at[1]['model'], ck['model'])
    assert learn.divergence_guard.events[-1]['action'] == 'rollback'

def test_skipped_step_leaves_asgd_average_alone(tmp_path):
    "An inf gradient under ASGD: the step is skipped and the running average `ax` is not touched (it was poisoned before)"
    class AX(Callback):
        order = 13
        def __init__(self): self.ax = {}
        def before_step(self): self.ax[('pre', self.epoch, self.iter)] = self.opt.state[self.model.flat.param].get('ax', torch.zeros(1)).clone()
        def after_step(self): self.ax[(self.epoch, self.iter)] = self.opt.state[self.model.flat.param]['ax'].clone()
    ax = AX()
    learn = tiny_train(tmp_path, asgd=True, on_nan='skip', cbs=[Inject(at=(1, 3), grad=True), ax]); fit(learn, 2)
    assert torch.equal(ax.ax[(1, 3)], ax.ax[('pre', 1, 3)]) and not torch.equal(ax.ax[(1, 4)], ax.ax[(1, 3)])
    assert torch.isfinite(learn.asgd_switch.averages()).all()
    assert files(tmp_path) == ['best.pth', 'epoch_0000.pth', 'epoch_0001.pth'] or files(tmp_path) == ['best.pth', 'epoch_0001.pth']

def test_rollback_to_before_the_asgd_switch(tmp_path):
    learn = tiny_train(tmp_path); fit(learn, 1)
    learn.asgd_switch.switch()
    restore(learn, load_checkpoint(tmp_path/'checkpoints'/'epoch_0000.pth'), full=False)
    assert not learn.asgd_switch.active and learn.asgd_switch.averages() is None
    assert 'ax' not in str(learn.opt.state_dict())

# ---------------------------------------------------------------- rotation and temporary files
@pytest.mark.slow
def test_rotation_never_deletes_this_runs_newest(tmp_path, capsys):
    "Stale, higher-numbered checkpoints of an earlier run: rotation and rollback use this run's files, and leave them alone"
    ck = tmp_path/'checkpoints'; ck.mkdir()
    for e in (7, 8): (ck/f'epoch_{e:04d}.pth').write_bytes(b'an earlier run')
    learn = safe_tar(build(tmp_path, 0, keep=2, on_nan='rollback', cbs=[Inject(at=(2, 3), grad=True)])); fit(learn, 3)
    assert files(tmp_path) == ['best.pth', 'epoch_0001.pth', 'epoch_0002.pth', 'epoch_0007.pth', 'epoch_0008.pth']
    assert (ck/'epoch_0008.pth').read_bytes() == b'an earlier run'
    assert f"rolled back the model and the optimizers to {ck/'epoch_0001.pth'}" in capsys.readouterr().out
    assert load_checkpoint(ck/'epoch_0002.pth')['cbs']['Checkpoint']['written'] == ['epoch_0001.pth', 'epoch_0002.pth']
    # a resumed run goes on rotating the files of the run it resumed from
    learn = safe_tar(build(tmp_path, 0, keep=2, resume=ck/'epoch_0002.pth')); fit(learn, 5)
    assert files(tmp_path) == ['best.pth', 'epoch_0003.pth', 'epoch_0004.pth', 'epoch_0007.pth', 'epoch_0008.pth']

def test_resume_removes_temporary_files_of_dead_writers(tmp_path, capsys):
    learn = tiny_train(tmp_path); fit(learn, 1)
    dead = int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True).stdout)
    live = os.getppid()
    junk = [tmp_path/'checkpoints'/f'.epoch_0001.pth.tmp{dead}', tmp_path/'checkpoints'/f'.best.pth.tmp{dead}', tmp_path/f'.run.json.tmp{dead}']
    keep = [tmp_path/'checkpoints'/f'.epoch_0001.pth.tmp{live}', tmp_path/f'.notes.txt.tmp{dead}']
    for p in junk + keep: p.write_bytes(b'half a file')
    learn = tiny_train(tmp_path, resume=True); fit(learn, 2)
    assert not any(p.exists() for p in junk) and all(p.exists() for p in keep)
    assert "removed temporary files left by a killed run: " in capsys.readouterr().out

# ---------------------------------------------------------------- log.csv in process
def test_runlogger_in_process(tmp_path, capsys):
    "Resume from an earlier checkpoint: later rows dropped; validate() leaves the log alone; other columns are an error"
    from rnn_darts.callbacks.logs import RunLogger
    learn = tiny_train(tmp_path, cbs=[RunLogger('log.csv', append=True)]); fit(learn, 2)
    log = (tmp_path/'log.csv').read_text().splitlines()
    assert log[0].startswith('epoch,train_loss,valid_loss') and [l.split(',')[0] for l in log[1:]] == ['0', '1']
    learn.validate()
    assert (tmp_path/'log.csv').read_text().splitlines() == log
    learn = tiny_train(tmp_path, cbs=[RunLogger('log.csv', append=True)], resume=tmp_path/'checkpoints'/'epoch_0000.pth'); fit(learn, 2)
    new = (tmp_path/'log.csv').read_text().splitlines()
    assert new[:2] == log[:2] and len(new) == 3 and new[2].split(',')[:3] == log[2].split(',')[:3]   # epoch 1 redone, once
    assert "dropped the rows of epochs [1]" in capsys.readouterr().out
    (tmp_path/'log.csv').write_text('epoch,loss,time\n0,1.0,00:01\n')
    learn = tiny_train(tmp_path, cbs=[RunLogger('log.csv', append=True)], resume=True)
    with pytest.raises(ValueError, match=r"log\.csv: its columns \(epoch,loss,time\) are not this run's \(epoch,train_loss,valid_loss,"):
        fit(learn, 3)

# ---------------------------------------------------------------- lr_find and run.json
def test_guard_neither_stops_nor_rolls_back_inside_lr_find(tmp_path, capsys):
    "lr_find's rates diverge by design: a non-finite step there is skipped, and the epoch's check neither stops nor logs"
    learn = tiny_train(tmp_path, on_nan='stop')
    inj = Inject((0, 3), loss=True); learn.add_cb(inj)
    with learn.no_bar(): learn.lr_find(num_it=30, show_plot=False)   # 30 batches: crosses the end of an epoch (after_train)
    learn.remove_cb(inj)
    assert 'w_before' in inj.seen and learn.divergence_guard.events == []
    assert 'non-finite' not in capsys.readouterr().out
    fit(learn, 1)
    assert learn.divergence_guard.events == []

def test_lr_find_leaves_the_resume_to_the_fit(tmp_path, capsys):
    learn = tiny_train(tmp_path); fit(learn, 1)
    learn = tiny_train(tmp_path, resume=True)
    with learn.no_bar(): learn.lr_find(num_it=5, show_plot=False)
    assert learn.checkpoint.resume is True and 'resumed from' not in capsys.readouterr().out
    fit(learn, 2)
    assert 'resumed from' in capsys.readouterr().out and len(learn.recorder.values) == 1   # epoch 1 only: it resumed

def test_run_info_never_takes_a_non_finite_valid_loss_as_best(tmp_path):
    import json
    from rnn_darts.learner import RunInfo
    sv = SetValid(0, INF)
    learn = tiny_train(tmp_path, cbs=[sv, RunInfo('train')])
    with pytest.raises(RuntimeError, match='no epoch of this run had a finite validation loss'): fit(learn, 1)   # run.json is written first
    text = (tmp_path/'run.json').read_text()
    assert json.loads(text)['best_valid_loss'] is None and 'Infinity' not in text   # `v == v` let inf in (and wrote `Infinity`)
