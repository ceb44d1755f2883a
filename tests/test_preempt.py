"""Interrupted, preempted or fed other data, through the command line: SIGINT and SIGTERM mid-epoch save the run and
say how to resume it, and the resumed run ends as one never interrupted; a second signal stops at once and leaves
whole files; changed data is refused; a failed write names its file."""
import errno, json, os, re, shlex, signal, subprocess, sys, time
from pathlib import Path
import pytest, torch
from rnn_darts import cli, runs
from rnn_darts.callbacks.checkpoint import load_checkpoint, latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]

def corpus(d, n=700):
    "A small corpus folder (its train split long enough for a few seconds an epoch at one thread: a signal lands inside an epoch)"
    d.mkdir(parents=True, exist_ok=True)
    words = 'the cat sat on a mat and saw one dog run to the red barn at noon'.split()
    for s, k in (('train', n), ('valid', 300), ('test', 200)):
        (d/f'{s}.txt').write_text(''.join(' ' + ' '.join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 9)) + ' \n' for i in range(k)))
    return d

def args(data, out, *more):
    # eager (--compile false): a longer run would pass AutoCompile's 150 batches, and each process would spend ~40 s compiling;
    # no λ_max (--curvature false): it doubles an epoch's time, and its state's resume is tests/test_resume.py's
    return ['search', '--curvature', 'false', '--data', str(data), '--epochs', '2', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '16',
            '--nhid', '16', '--mode', 'first', '--device', 'cpu', '--threads', '1', '--compile', 'false', '--out', str(out), *more]

def launch(argv):
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    return subprocess.Popen([sys.executable, '-m', 'rnn_darts.cli', *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

def wait_for(p, cond, what, limit=300):
    t0 = time.time()
    while not cond():
        assert p.poll() is None, p.communicate()
        assert time.time() - t0 < limit, f"no {what} after {limit} s"
        time.sleep(0.01)

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

@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    "The uninterrupted run every interrupted one must end as"
    d = tmp_path_factory.mktemp('pre')
    data = corpus(d/'corpus')
    p = launch(args(data, d/'ref')); out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return data, d/'ref'

@pytest.mark.slow
@pytest.mark.xdist_group('preempt-reference')
def test_sigterm_mid_epoch_then_resume_is_exact(reference, tmp_path):
    "SIGTERM (SIGINT takes the same handler: its exit status 130 below) mid-epoch, then the printed resume line: the uninterrupted run, bit for bit"
    data, ref = reference
    run, sig = tmp_path/'run', signal.SIGTERM
    argv = args(data, run, '--overwrite')   # the resume line must leave --overwrite out
    p = launch(argv)
    wait_for(p, lambda: (run/'checkpoints'/'epoch_0000.pth').exists(), 'first checkpoint')
    time.sleep(0.3)                                            # inside epoch 1
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, err
    name = signal.Signals(sig).name
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"rnn-darts: {name} at epoch (\d), after batch (\d+) of (\d+): saved to (\S+); resume with: (.+)", last)
    assert m, err
    assert 'Traceback' not in err and Path(m[4]) == run/'checkpoints'/'mid_epoch.pth' and Path(m[4]).is_file()
    assert not (run/'genotype.json').exists()                  # the search did not end
    mid = load_checkpoint(m[4])
    assert mid['epoch'] == int(m[1]) and mid['mid']['batches'] == int(m[2]) < int(m[3])
    before = mid['cbs']['RunInfo']['epoch_seconds']            # the epoch's time before the signal, carried into the resumed run
    assert 0.2 < before < 300
    r = launch(shlex.split(m[5])[1:]); out, err = r.communicate(timeout=600)   # the printed command, as a user would paste it
    assert r.returncode == 0, err
    assert f"(epoch {m[1]}, after batch {m[2]} of {m[3]})" in out
    assert json.loads((run/'run.json').read_text())['epoch_times'][int(m[1])] > before
    same_run(ref, run)
    assert not (run/'checkpoints'/'mid_epoch.pth').exists()    # superseded by the later epoch checkpoints

@pytest.mark.slow
@pytest.mark.xdist_group('preempt-reference')
def test_second_sigint_stops_at_once_and_leaves_whole_files(reference, tmp_path):
    data, ref = reference
    run = tmp_path/'run'
    p = launch(args(data, run))
    wait_for(p, lambda: (run/'checkpoints'/'epoch_0000.pth').exists(), 'first checkpoint')
    p.send_signal(signal.SIGINT); p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and 'Traceback' not in err, err
    assert err.strip().splitlines()[-1].startswith('rnn-darts: ')
    for f in (run/'checkpoints').iterdir(): load_checkpoint(f) if f.suffix == '.pth' else None   # every checkpoint loads
    json.loads((run/'run.json').read_text())
    r = launch(args(data, run, '--resume')); out, err = r.communicate(timeout=600)
    assert r.returncode == 0, err
    same_run(ref, run)
    assert not [f for f in (run/'checkpoints').iterdir() if '.tmp' in f.name]

@pytest.mark.slow
def test_checkpoint_every_writes_mid_epoch_states(tmp_path):
    "--checkpoint-every (minutes): mid-epoch checkpoints without stopping; changing it on --resume is free"
    data = corpus(tmp_path/'c', 400)
    learn = cli.run_command(args(data, tmp_path/'r', '--checkpoint-every', '0.00001', '--epochs', '1'))
    assert learn.preemption.every == pytest.approx(0.0006)
    assert not (tmp_path/'r'/'checkpoints'/'mid_epoch.pth').exists()   # written, then superseded at the epoch's end
    cli.run_command(args(data, tmp_path/'r', '--epochs', '2', '--resume'))   # no --override needed

def test_a_resumed_epoch_counts_its_time_before_the_stop(tmp_path):
    "run.json's epoch_times (a study's search time) hold a whole epoch's time: `RunInfo` saves the seconds so far mid-epoch"
    from fastai.callback.core import Callback
    from rnn_darts.data import numbers_corpus, lm_dls
    from rnn_darts.learner import train_learner, RunInfo
    from rnn_darts.genotypes import DARTS_V2
    c = numbers_corpus(n_train=1_500, n_valid=600, n_test=400)
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
def test_fewer_epochs_than_done_are_refused_on_resume(tmp_path, capsys):
    data = corpus(tmp_path/'c', 300)
    cli.run_command(args(data, tmp_path/'r', '--epochs', '2'))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, tmp_path/'r', '--epochs', '1', '--resume', '--override', 'true'))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and f"--epochs 1: {tmp_path/'r'} has done 2 epochs" in err

@pytest.mark.slow
def test_changed_data_is_refused_on_resume(tmp_path, capsys):
    data = corpus(tmp_path/'c', 400)
    cli.run_command(args(data, tmp_path/'r', '--epochs', '1'))
    info = json.loads((tmp_path/'r'/'run.json').read_text())
    assert info['data']['train']['file'] == str(data/'train.txt') and len(info['data']['train']['sha256']) == 64
    (data/'train.txt').write_text((data/'train.txt').read_text() + ' the cat \n')
    capsys.readouterr()
    with pytest.raises(SystemExit) as e: cli.run_command(args(data, tmp_path/'r', '--epochs', '2', '--resume'))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1
    assert f"--resume: the data train changed since the run started: it was {data/'train.txt'} (" in err and '--override true' in err
    cli.run_command(args(data, tmp_path/'r', '--epochs', '2', '--resume', '--override', 'true'))
    info = json.loads((tmp_path/'r'/'run.json').read_text())
    assert 'data train' in info['overrides'][-1]['changes'] and info['data']['train']['size'] == (data/'train.txt').stat().st_size

@pytest.mark.slow
@pytest.mark.parametrize('target', ['run.json', 'log.csv', 'genotype.json', 'epoch_0000.pth'])
def test_a_failed_write_names_its_file(tmp_path, capsys, monkeypatch, target):
    "The disk fills up while one of the run's files is written (every write ends with an fsync): one line naming that file, exit 1"
    data, out = corpus(tmp_path/'c', 300), tmp_path/'r'
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
    mnt, data = small_disk, corpus(tmp_path/'c', 300)
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
    argv = (args(corpus(tmp_path/'c', 300), out, '--epochs', '1') if command == 'search'
            else ['study', '--preset', 'study-quick', '--out', str(out), '--threads', '1'])
    with pytest.raises(SystemExit) as e: cli.run_command(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err == f"rnn-darts: error: {out/'.lock'}: No space left on device\n", err

def test_a_signal_after_the_last_batch_still_stops_the_command(tmp_path):
    "SIGTERM during the last epoch's validation: the fit ends whole, yet the command stops (143) instead of going on"
    from fastai.callback.core import Callback
    from rnn_darts.core import set_seed
    from rnn_darts.data import numbers_corpus, lm_dls, search_stream
    from rnn_darts.learner import search_learner
    class LateSignal(Callback):
        def before_validate(self):
            if self.epoch == self.n_epoch - 1: signal.raise_signal(signal.SIGTERM)
    set_seed(0)
    c = numbers_corpus(0, 1500, 300, 300)
    learn = search_learner(lm_dls(c, 8, 10, 'search', eval_bs=4, seed=0), search_stream(c, 8), emsize=8, nhid=8, mode='first',
                           path=tmp_path, compile=False, curvature=False)
    before = signal.getsignal(signal.SIGTERM)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, cbs=[LateSignal()])
    n = len(learn.dls.train)
    assert learn.interrupted == dict(signal='SIGTERM', code=143, epoch=1, batch=n, of=n, path=str(tmp_path/'checkpoints'/'epoch_0001.pth'))
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(SystemExit) as e: runs.exit_if_interrupted(learn)
    assert e.value.code == 143
