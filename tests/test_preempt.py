"""Interrupted, preempted or fed other data, through the command line: SIGINT and SIGTERM mid-epoch save the run and
say how to resume it, and the resumed run ends as one never interrupted; a second signal stops at once and leaves
whole files; changed data is refused; a failed write names its file.

The corpora are small (20 training batches an epoch for the signals, 10 or fewer elsewhere): the in-process resumes are
proved exact for every part by tests/test_resume.py; here what only the command line does: the signal handlers, the
printed resume line, the exit statuses, the run folder's checks."""
import errno, json, os, re, shlex, signal, subprocess, sys
from pathlib import Path
import pytest, torch
from rnn_darts import cli, runs
from rnn_darts.callbacks.checkpoint import load_checkpoint, latest_checkpoint
from rnn_darts.callbacks.preemption import Preemption
from tests._signals import stop_at
from tests._learners import corpus_folder

ROOT = Path(__file__).resolve().parents[1]

def corpus(d, n=200, n_eval=60):
    """A small corpus folder of `n` training lines (~8 tokens each: n=200 gives 20 batches at bs 8, bptt 10, ~2 s of an epoch
    at one thread, so that a signal sent 0.3 s into an epoch lands inside it) and `n_eval` validation and test lines"""
    words = 'the cat sat on a mat and saw one dog run to the red barn at noon'.split()
    return Path(corpus_folder(d, lines=n, eval_lines=n_eval, words=words, length=lambda i: 3 + i % 9))

def args(data, out, *more):
    # eager (--compile false): a longer run would pass AutoCompile's 150 batches, and each process would spend ~40 s compiling;
    # no λ_max (--curvature false): it doubles an epoch's time, and its state's resume is tests/test_resume.py's
    return ['search', '--curvature', 'false', '--data', str(data), '--epochs', '2', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '16',
            '--nhid', '16', '--mode', 'first', '--device', 'cpu', '--threads', '1', '--compile', 'false', '--out', str(out), *more]

def launch(argv):
    "`rnn-darts ARGV` in a new process, its output piped"
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    return subprocess.Popen([sys.executable, '-m', 'rnn_darts.cli', *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

def log_rows(run):
    return [l.rsplit(',', 1)[0] for l in (run/'log.csv').read_text().splitlines()]   # without the time column

def final_weights(run):
    return load_checkpoint(latest_checkpoint(run/'checkpoints'))['model']

def same_run(ref, run):
    assert log_rows(ref) == log_rows(run)
    assert (ref/'genotype.json').read_text() == (run/'genotype.json').read_text()
    a, b = final_weights(ref), final_weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    h = lambda d: [(e['genotype'], e['weights'], e.get('lambda_max')) for e in json.loads((d/'history.json').read_text())]
    assert h(ref) == h(run)

def stopped(err, name):
    "The one line a signal's stop ends with: (epoch, batch, of, saved to, resume command)"
    assert 'Traceback' not in err, err
    m = re.fullmatch(rf"rnn-darts: {name} at epoch (\d), after batch (\d+) of (\d+): saved to (\S+); resume with: (.+)", err.strip().splitlines()[-1])
    assert m, err
    return m

@pytest.mark.slow
def test_sigterm_then_sigint_mid_epoch_then_the_printed_resume_line_is_exact(tmp_path):
    """SIGTERM mid-epoch saves the run and prints the line that resumes it (without --overwrite); that line, run, resumes
    inside the epoch, and SIGINT (the same handler, exit status 130) stops it again a few batches on, printing the same
    line; the line, run again to the end: the uninterrupted run, bit for bit. Four processes of ~8 s start-up each (the
    uninterrupted run alongside the first) and ~4 epochs of 20 batches in all: ~45 s on 2 cores"""
    data = corpus(tmp_path/'corpus')
    ref = launch(args(data, tmp_path/'ref'))                   # the uninterrupted run every interrupted one must end as
    run, mid_path = tmp_path/'run', tmp_path/'run'/'checkpoints'/'mid_epoch.pth'
    argv = args(data, run, '--overwrite')   # the resume line must leave --overwrite out
    code, out, err = stop_at(argv, 'run batch 25', signal.SIGTERM, tmp_path)   # ~20 batches an epoch: inside epoch 1
    assert code == 128 + signal.SIGTERM, err
    m = stopped(err, 'SIGTERM')
    assert Path(m[4]) == mid_path and mid_path.is_file() and m[1] == '1' and int(m[2]) == 25 - int(m[3])
    assert not json.loads((run/'run.json').read_text()).get('finished')   # the search did not end (genotype.json: epoch 0's cell)
    mid = load_checkpoint(mid_path)
    assert mid['epoch'] == int(m[1]) == 1 and mid['mid']['batches'] == int(m[2]) < int(m[3])
    before = mid['cbs']['RunInfo']['epoch_seconds']            # the epoch's time before the signal, carried into the resumed run
    assert 0 < before < 300
    line = shlex.split(m[5])                                   # the printed command, as a user would paste it
    assert line == ['rnn-darts', *[a for a in argv if a != '--overwrite'], '--resume'], line

    code, out, err = stop_at(line[1:], 'run batch 3', signal.SIGINT, tmp_path)   # the line, run: stopped by SIGINT 3 batches on
    assert code == 130, err
    assert f"resumed from {mid_path} (epoch 1, after batch {m[2]} of {m[3]})" in out
    m2 = stopped(err, 'SIGINT')
    assert (m2[1], m2[3], m2[4], m2[5]) == (m[1], m[3], m[4], m[5]) and int(m2[2]) == int(m[2]) + 3
    later = load_checkpoint(mid_path)['cbs']['RunInfo']['epoch_seconds']
    assert later > before

    r = launch(line[1:]); out, err = r.communicate(timeout=600)  # the line again, to the end
    assert r.returncode == 0, err
    assert f"resumed from {mid_path} (epoch 1, after batch {m2[2]} of {m2[3]})" in out
    assert json.loads((run/'run.json').read_text())['epoch_times'][1] > later
    out, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err
    same_run(tmp_path/'ref', run)
    assert not mid_path.exists()                               # superseded by the later epoch checkpoints
    assert not [f for f in (run/'checkpoints').iterdir() if '.tmp' in f.name]

@pytest.mark.slow
def test_resume_auto_is_one_command_for_every_start_and_a_bare_resume_reads_the_run(tmp_path):
    """A preemptible job's one command, `--resume auto`: in a folder a kill left with only `.lock` and log.csv's header it
    starts the run (nothing to continue); SIGTERM mid-epoch; the same command continues it; SIGINT; then `--resume --out
    RUN` with no other flag (the space is not the default one: --ops and --nodes come from run.json) runs it to the end:
    the uninterrupted run, bit for bit. Four processes (the uninterrupted one alongside the first), ~4 epochs of 20 batches"""
    data, run = corpus(tmp_path/'corpus'), tmp_path/'run'
    space = ('--ops', 'tanh,relu,gelu', '--nodes', '5')
    ref = launch(args(data, tmp_path/'ref', *space))
    run.mkdir(); (run/'.lock').touch(); (run/'log.csv').write_text('epoch,train_loss,valid_loss,perplexity,search_loss,time\n')   # a kill's leftovers
    argv = args(data, run, *space, '--resume', 'auto')
    code, out, err = stop_at(argv, 'run batch 25', signal.SIGTERM, tmp_path)
    assert code == 128 + signal.SIGTERM, err
    assert f"--resume auto: no checkpoint to continue in {run}: starting the run" in out
    assert stopped(err, 'SIGTERM')[1] == '1'
    code, out, err = stop_at(argv, 'run batch 3', signal.SIGINT, tmp_path)   # the same command: continues
    assert code == 130, err
    assert f"--resume auto: continuing the run in {run}" in out and f"resumed from {run/'checkpoints'/'mid_epoch.pth'} (epoch 1" in out
    r = launch(['search', '--resume', '--out', str(run)]); out, err = r.communicate(timeout=600)
    assert r.returncode == 0, err
    out, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err
    same_run(tmp_path/'ref', run)
    info = json.loads((run/'run.json').read_text())
    assert info['finished'] and info['settings']['ops'] == 'tanh,relu,gelu' and info['settings']['nodes'] == 5

@pytest.mark.slow
def test_a_second_sigint_stops_at_once_and_leaves_whole_files(tmp_path, capsys, monkeypatch):
    """Two SIGINTs inside one batch (raised in the process: two sent from outside arrive as one when the first is not yet
    handled): the first asks to stop after the batch, the second stops at once, through the command line: exit 130, one
    line, no mid-epoch checkpoint, the handlers put back, the files written whole; --resume goes on from the last epoch's
    checkpoint. In process, ~2 epochs of 10 batches"""
    data, out = corpus(tmp_path/'c', 100), tmp_path/'r'
    after_batch, sigint = Preemption.after_batch, signal.getsignal(signal.SIGINT)
    def twice(self):
        if self.training and (self.epoch, self.iter) == (1, 2):
            signal.raise_signal(signal.SIGINT)                  # taken by Preemption: stop after this batch
            signal.raise_signal(signal.SIGINT)                  # before the batch has ended: at once
        after_batch(self)
    monkeypatch.setattr(Preemption, 'after_batch', twice)
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, out))
    err = capsys.readouterr().err
    assert e.value.code == 130 and 'Traceback' not in err, err
    assert err.strip().splitlines() == ["SIGINT: stopping after this batch and saving the run; SIGINT again stops at once",
        "rnn-darts: interrupted at once (a second Ctrl-C); the files written so far are whole; resume with --resume"], err
    assert signal.getsignal(signal.SIGINT) is sigint
    assert sorted(f.name for f in (out/'checkpoints').iterdir()) == ['best.pth', 'epoch_0000.pth']   # no mid-epoch checkpoint, no temporary file
    for f in (out/'checkpoints').iterdir(): load_checkpoint(f)
    json.loads((out/'run.json').read_text())
    monkeypatch.undo()
    cli.run_command(args(data, out, '--resume'))
    assert f"resumed from {out/'checkpoints'/'epoch_0000.pth'} (epoch 0)" in capsys.readouterr().out
    assert len(json.loads((out/'run.json').read_text())['epoch_times']) == 2

def test_a_resumed_epoch_counts_its_time_before_the_stop(tmp_path):
    "run.json's epoch_times (a study's search time) hold a whole epoch's time: `RunInfo` saves the seconds so far mid-epoch"
    from fastai.callback.core import Callback
    from rnn_darts.data import numbers_corpus, lm_dls
    from rnn_darts.learner import train_learner, RunInfo
    from rnn_darts.genotypes import DARTS_V2
    c = numbers_corpus(n_train=800, n_valid=300, n_test=100)
    learn = train_learner(lm_dls(c, bs=8, bptt=10, phase='train', eval_bs=4), DARTS_V2, emsize=16, nhid=16, path=tmp_path, checkpoint=False)
    ri, seen = RunInfo('train'), []
    class Peek(Callback):
        order = RunInfo.order + 1
        def after_batch(self): seen.append(ri.ckpt_state()['epoch_seconds'])    # what a mid-epoch checkpoint would hold
        def after_epoch(self): seen.append(ri.ckpt_state()['epoch_seconds'])    # an epoch's checkpoint: nothing to carry
    with learn.no_bar(): learn.fit(1, cbs=[ri, Peek()])
    assert 0 < seen[0] < seen[-2] <= ri.info['epoch_times'][0] and seen[-1] == 0
    resumed = RunInfo('train'); resumed.load_ckpt_state(dict(info=ri.info, epoch_seconds=1000.))   # as `Checkpoint` resumes it
    with learn.no_bar(): learn.fit(2, cbs=[resumed])
    t = resumed.info['epoch_times']
    assert 1000 < t[0] < 1000 + 60 and t[1] < 60                            # carried into the resumed epoch only

@pytest.mark.slow
def test_what_a_resume_may_change(tmp_path, capsys):
    """One run, resumed three times: --checkpoint-every (minutes) writes mid-epoch states without stopping, and changing it
    on --resume is free; fewer epochs than done are refused; changed data is refused, and goes on with --override true
    (recorded in run.json). 3 epochs of 10 batches in all"""
    data, r = corpus(tmp_path/'c', 100), tmp_path/'r'
    learn = cli.run_command(args(data, r, '--checkpoint-every', '0.00001', '--epochs', '1'))
    assert learn.preemption.every == pytest.approx(0.0006)
    assert not (r/'checkpoints'/'mid_epoch.pth').exists()   # written, then superseded at the epoch's end
    info = json.loads((r/'run.json').read_text())
    assert info['data']['train']['file'] == str(data/'train.txt') and len(info['data']['train']['sha256']) == 64
    cli.run_command(args(data, r, '--epochs', '2', '--resume'))   # no --override needed
    capsys.readouterr()
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, r, '--epochs', '1', '--resume', '--override', 'true'))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and f"--epochs 1: {r} has done 2 epochs" in err
    (data/'train.txt').write_text((data/'train.txt').read_text() + ' the cat \n')
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, r, '--epochs', '3', '--resume'))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1
    assert f"--resume: the data changed since the run started (the data train was {data/'train.txt'} (" in err and '--override true' in err
    cli.run_command(args(data, r, '--epochs', '3', '--resume', '--override', 'true'))
    info = json.loads((r/'run.json').read_text())
    assert 'data train' in info['overrides'][-1]['changes'] and info['data']['train']['size'] == (data/'train.txt').stat().st_size
    assert len(info['epoch_times']) == 3

@pytest.mark.slow
@pytest.mark.parametrize('target', ['run.json', 'log.csv', 'genotype.json', 'epoch_0000.pth'])
def test_a_failed_write_names_its_file(tmp_path, capsys, monkeypatch, target):
    "The disk fills up while one of the run's files is written (every write ends with an fsync): one line naming that file, exit 1, no file of the run left open"
    data, out = corpus(tmp_path/'c', 50, 20), tmp_path/'r'
    real = os.fsync
    def fsync(fd):
        if os.readlink(f'/proc/self/fd/{fd}').split('/')[-1].lstrip('.').startswith(target): raise OSError(errno.ENOSPC, 'No space left on device')
        return real(fd)
    monkeypatch.setattr(os, 'fsync', fsync)
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, out, '--epochs', '1'))
    err = capsys.readouterr().err
    want = (f"no space left on device while writing checkpoint {out/'checkpoints'/target}" if target.endswith('.pth')
            else f"{out/target}: No space left on device")
    assert e.value.code == 1 and err.count('\n') == 1 and want in err, err
    assert not [f for f in out.rglob('*') if '.tmp' in f.name]       # no temporary file left behind
    held = [os.readlink(f) for f in Path('/proc/self/fd').iterdir() if os.path.lexists(f)]
    assert not [f for f in held if f.startswith(str(out))], held     # a fit ended by the error gets no after_fit: log.csv was left open

@pytest.fixture
def small_disk(tmp_path):
    "A 256 kB tmpfs (where the system lets us mount one), unmounted after the test"
    mnt = tmp_path/'small'; mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', str(mnt)], capture_output=True).returncode:
        pytest.skip('cannot mount a tmpfs here')
    try: yield mnt
    finally: subprocess.run(['umount', '-l', str(mnt)])

@pytest.mark.slow
def test_a_real_full_disk(tmp_path, capsys, small_disk):
    "A 256 kB tmpfs as the run folder: the checkpoint is named, run.json stays whole"
    mnt, data = small_disk, corpus(tmp_path/'c', 50, 20)
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, mnt/'r', '--epochs', '1', '--nhid', '64', '--emsize', '64'))
    err = capsys.readouterr().err
    assert e.value.code == 1 and f"while writing checkpoint {mnt/'r'/'checkpoints'}" in err, err
    if (mnt/'r'/'run.json').exists(): json.loads((mnt/'r'/'run.json').read_text())

@pytest.mark.parametrize('command', ['search', 'study'])
def test_a_disk_full_from_the_start_names_the_first_file(tmp_path, capsys, small_disk, command):
    "The tmpfs filled before the run: the first write (the run folder's lock) fails, and the one line names it"
    with open(small_disk/'filler', 'wb', buffering=0) as f:
        try:
            while True: f.write(b'\0' * 4096)
        except OSError as e: assert e.errno == errno.ENOSPC
    out = small_disk/'r'
    argv = (args(corpus(tmp_path/'c', 50, 20), out, '--epochs', '1') if command == 'search'
            else ['study', '--preset', 'study-quick', '--out', str(out), '--threads', '1'])
    with pytest.raises(SystemExit) as e: cli.run_command(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err == f"rnn-darts: error: {out/'.lock'}: No space left on device\n", err

def test_a_signal_after_the_last_batch_still_stops_the_command(tmp_path):
    """SIGTERM during the last epoch's validation: the fit ends whole, yet the command stops (143) instead of going on.
    A signal in `learn.validate()` (a command's test evaluation) acts at once: it is not taken, and forgotten"""
    from fastai.callback.core import Callback
    from rnn_darts.core import set_seed
    from rnn_darts.data import numbers_corpus, lm_dls, search_stream
    from rnn_darts.learner import search_learner
    class LateSignal(Callback):
        def before_validate(self):
            if self.epoch == self.n_epoch - 1: signal.raise_signal(signal.SIGTERM)
    set_seed(0)
    c = numbers_corpus(0, 800, 300, 100)
    learn = search_learner(lm_dls(c, 8, 10, 'search', eval_bs=4, seed=0), search_stream(c, 8), emsize=8, nhid=8, mode='first',
                           path=tmp_path, compile=False, curvature=False)
    before = signal.getsignal(signal.SIGTERM)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, cbs=[LateSignal()])
    n = len(learn.dls.train)
    assert learn.interrupted == dict(signal='SIGTERM', code=143, epoch=1, batch=n, of=n, path=str(tmp_path/'checkpoints'/'epoch_0001.pth'))
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(SystemExit) as e: runs.exit_if_interrupted(learn)
    assert e.value.code == 143
    class SignalInValidate(Callback):
        def before_validate(self): signal.raise_signal(signal.SIGINT)
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)          # Python's own: KeyboardInterrupt
    try:
        with pytest.raises(KeyboardInterrupt): learn.validate(cbs=[SignalInValidate()])
    finally: signal.signal(signal.SIGINT, sigint)
