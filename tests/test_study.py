"""`rnn-darts study` (issue 25): the paper's protocol as one command, run as a user runs it. Tiny presets of our own:
a first-order and a random search, their short trainings and DARTS_V2's, the winner's final training. The stages
are the same runs as `rnn-darts search|train` with the same flags; a kill and a rerun give the same table; stages
run alone (a scheduler's jobs) and then collected give the same table; bad settings get one line.
Each search and training has about 19 batches (1,500 tokens), its validation 600 tokens."""
import contextlib, importlib.util, io, json, math, os, re, shlex, shutil, signal, socket, subprocess, sys, threading, time
from pathlib import Path
import pandas as pd, pytest
from rnn_darts import cli
from rnn_darts.study import STUDY_COLUMNS
from rnn_darts.genotypes import load_genotype
from rnn_darts.callbacks.checkpoint import load_checkpoint
from tests._signals import Job, stop_at

ROOT = Path(__file__).resolve().parents[1]
TINY = """
[tiny-search]
data = numbers
n_train = 1500
n_eval = 600
epochs = 1
bs = 8
bptt = 10
eval_bs = 4
emsize = 16
nhid = 16
candidates = 12
top = 3
seed = 99
curvature = false

[tiny-train]
data = numbers
n_train = 1500
n_eval = 600
bs = 8
bptt = 10
eval_bs = 4
test_bs = 4
emsize = 16
nhid = 16
epochs = 50

[tiny-study]
methods = first,random
seeds = 1
references = DARTS_V2
search_preset = tiny-search
train_preset = tiny-train
short_epochs = 1
final_epochs = 2
"""
pytestmark = pytest.mark.xdist_group('study')   # `done`, the finished study, made once

STAGES = ['search-first-1', 'search-random-1', 'short-search-first-1', 'short-search-random-1', 'short-DARTS_V2', 'final']

def ini(d):
    p = Path(d)/'settings.ini'; p.write_text(TINY); return p

def study_args(d, out, *more):
    return ['study', '--preset', 'tiny-study', '--settings', str(Path(d)/'settings.ini'), '--out', str(out), '--device', 'cpu',
            '--threads', '1', *more]

def table(out):
    "study.csv without the search's compute time (the one column a rerun may change)"
    return pd.read_csv(Path(out)/'study.csv').drop(columns=['search_seconds'])

@pytest.fixture(scope='module')
def done(tmp_path_factory):
    "An uninterrupted tiny study, and its stdout (run in this process: the kill test runs the command as a user does, by subprocess)"
    d = tmp_path_factory.mktemp('study'); ini(d)
    said = io.StringIO()
    with contextlib.redirect_stdout(said): cli.run_command(study_args(d, d/'s', *BOARD(d)))
    return d, d/'s', said.getvalue()

HAS_TB = importlib.util.find_spec('tensorboard') is not None
BOARD = lambda d: ['--tensorboard', str(Path(d)/'tb')] if HAS_TB else []   # a study writes its stages' runs there; a resume may drop it

def board_epochs(folder) -> list:
    "The epochs of the validation loss in the TensorBoard run `folder`, as TensorBoard reads them"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    return [x.step for x in EventAccumulator(str(folder)).Reload().Scalars('valid_loss')]

@pytest.mark.slow
def test_study_runs_every_stage_and_tells_the_truth(done):
    d, s, stdout = done
    assert '\r' not in stdout and '█' not in stdout, stdout[:400]     # into a file or pipe: lines, no bar frames (its searches, scoring, trainings)
    lines = [l for l in stdout.splitlines() if l.startswith('study [')]
    assert [l.split()[2].rstrip(':') for l in lines] == [x for x in STAGES for _ in (0, 1)]   # a line as each starts and ends
    assert all(': starts (' in l and 'so far' in l for l in lines[::2]) and all('done in' in l for l in lines[1::2])
    assert all(re.search(r'best validation perplexity [\d,]+\.\d$', l) for l in lines[1::2]), lines   # each stage's figure as it ends
    assert re.search(r'the time left is known once a stage has finished, and search-first-1 is \d+% of the planned work left', lines[0]), lines[0]  # the first stage: its share
    assert all(' left)' in l for l in lines[2::2])                     # every later stage: its planned work at the finished stages' rate
    df = pd.read_csv(s/'study.csv')
    assert list(df.columns) == list(STUDY_COLUMNS)
    for st in STAGES if HAS_TB else []:                                # --tensorboard: each stage its own run, each epoch once
        assert board_epochs(d/'tb'/st) == list(range(len(json.loads((s/st/'run.json').read_text())['epoch_times']))), st
    assert list(df.stage) == STAGES[2:5] and list(df.method) == ['first', 'random', 'reference']
    for _, r in df.iterrows():                                         # each number is its stage's own record
        rec = json.loads((s/r.stage/'run.json').read_text())
        assert rec['finished'] and math.isclose(r.short_valid_ppl, math.exp(rec['best_valid_loss']), rel_tol=1e-9)
        assert rec['settings']['epochs'] == 1 and rec['settings']['nhid'] == 16
        if r.method != 'reference':
            src = json.loads((s/r.stage.removeprefix('short-')/'run.json').read_text())
            assert math.isclose(r.search_seconds, sum(src['epoch_times']) + (src.get('candidates') or {}).get('seconds', 0))
            written = json.loads((s/r.stage.removeprefix('short-')/'genotype.json').read_text())
            assert written.pop('ops') == ['tanh', 'relu', 'sigmoid', 'identity'] and json.loads(r.genotype) == written   # the cell; its search's op set in its file
    searched = df[df.method != 'reference']
    assert df.selected.sum() == 1 and df.selected[searched.short_valid_loss.idxmin()]          # the best searched cell
    w = df[df.selected].iloc[0]
    fin = json.loads((s/'final'/'run.json').read_text())
    assert load_genotype(fin['settings']['genotype']) == load_genotype(s/w.stage.removeprefix('short-')/'genotype.json')
    assert fin['settings']['epochs'] == 2 and math.isclose(w.final_test_ppl, fin['test_ppl'])
    assert df[~df.selected].final_test_ppl.isna().all()
    report = (s/'report'/'report.md').read_text()
    assert all(st in report for st in STAGES[2:5]) and (s/'report'/'candidates.png').stat().st_size > 1000
    assert f"test {w.final_test_ppl:.2f}" in report
    (s/'report'/'report.md').unlink()
    cli.run_command(['report', str(s)])                                # `rnn-darts report STUDY` writes it again
    assert (s/'report'/'report.md').read_text() == report

@pytest.mark.slow
def test_a_stage_is_the_run_the_command_makes(done, tmp_path):
    "search-first-1 equals `rnn-darts search` with the search preset, seed 1 and --mode first: same log, same cell"
    d, s, _ = done
    cli.run_command(['search', '--preset', 'tiny-search', '--settings', str(d/'settings.ini'), '--seed', '1', '--mode', 'first',
                     '--device', 'cpu', '--threads', '1', '--out', str(tmp_path/'alone')])
    rows = lambda p: [l.rsplit(',', 1)[0] for l in (p/'log.csv').read_text().splitlines()]
    assert rows(tmp_path/'alone') == rows(s/'search-first-1')
    assert (tmp_path/'alone'/'genotype.json').read_text() == (s/'search-first-1'/'genotype.json').read_text()

@pytest.mark.slow
def test_run_again_skips_and_changed_settings_are_refused(done, tmp_path, capsys):
    d, s, _ = done
    s2 = tmp_path/'s'; shutil.copytree(s, s2)
    before = (s2/'study.csv').read_text()
    cli.run_command(study_args(d, s2))
    assert capsys.readouterr().out.count('skipped') == len(STAGES)
    cli.run_command(['study', '--resume', '--out', str(s2), '--device', 'cpu', '--threads', '1'])   # no preset, no settings file: study.json's
    assert capsys.readouterr().out.count('skipped') == len(STAGES)
    assert (s2/'study.csv').read_text() == before
    with pytest.raises(SystemExit) as e: cli.run_command(study_args(d, s2, '--final-epochs', '3'))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count('\n') == 0 and str(s2/'study.json') in err and "final_epochs: 2 -> 3" in err
    cli.run_command(study_args(d, s2, '--final-epochs', '3', '--override', 'true'))   # the final training continues to 3 epochs
    out = capsys.readouterr().out
    assert out.count('skipped') == len(STAGES) - 1 and 'resumed from' in out
    assert len(json.loads((s2/'final'/'run.json').read_text())['epoch_times']) == 3
    assert json.loads((s2/'study.json').read_text())['overrides'] == [dict(final_epochs=dict(old=2, new=3))]
    new, old = table(s2), table(s)
    pd.testing.assert_frame_equal(new.drop(columns=['final_valid_ppl', 'final_test_ppl']), old.drop(columns=['final_valid_ppl', 'final_test_ppl']))

@pytest.mark.slow
def test_killed_study_resumes_to_the_same_table(done, tmp_path, capsys):
    """SIGTERM after the third batch of the first cell's short training; running again goes on from that batch, and is
    SIGKILLed after the third batch of the reference's short training; --resume ends with the uninterrupted study's table.
    One study's work over three runs, the two killed ones by subprocess (the signals are the point): over 20 s for that"""
    d, s, _ = done
    out = tmp_path/'s'
    code, _, err = stop_at(study_args(d, out), 'short-search-first-1 batch 3', signal.SIGTERM, tmp_path)
    assert code == 143, err                                            # caught inside the fit: the resume line repeats the study command
    assert 'resume with: rnn-darts study --preset tiny-study' in err and '--resume' not in err
    mid = load_checkpoint(out/'short-search-first-1'/'checkpoints'/'mid_epoch.pth')['mid']
    assert mid['batches'] == 3 < mid['of']
    again, said, err = stop_at(study_args(d, out), 'short-DARTS_V2 batch 3', signal.SIGKILL, tmp_path)   # running again: what the resume line says to do
    assert again == -9, err
    assert f"resumed from {out/'short-search-first-1'/'checkpoints'/'mid_epoch.pth'} (epoch 0, after batch 3 of" in said   # the stopped stage went on from there
    capsys.readouterr()
    cli.run_command(study_args(d, out, '--resume'))                    # --resume: what running again does
    pd.testing.assert_frame_equal(table(out), table(s))

@pytest.mark.slow
def test_stages_alone_then_collected_give_the_same_table(done, tmp_path, capsys):
    "Three stages alone in a scheduler's order, then the rest collected: the uninterrupted table. It runs every stage once (a whole study's work)"
    d, s, _ = done
    out = tmp_path/'s'
    with pytest.raises(SystemExit) as e: cli.run_command(study_args(d, out, '--stage', 'short-search-first-1'))
    err = capsys.readouterr().err
    assert e.value.code == 2 and 'needs search-first-1 done first' in err
    for st in ('search-random-1', 'search-first-1', 'short-search-first-1'):   # any order a scheduler picks
        cli.run_command(study_args(d, out, '--stage', st))
    assert not (out/'study.csv').exists()
    with pytest.raises(SystemExit) as e: cli.run_command(study_args(d, out, '--stage', 'final'))
    assert e.value.code == 2 and 'needs short-search-random-1, short-DARTS_V2 done first' in capsys.readouterr().err
    cli.run_command(study_args(d, out))                                # collects: runs what is left
    assert capsys.readouterr().out.count('skipped') == 3
    pd.testing.assert_frame_equal(table(out), table(s))
    rec = (out/'search-first-1'/'run.json').read_text()
    cli.run_command(study_args(d, out, '--stage', 'search-first-1'))   # a scheduler's retry of a finished stage
    assert 'search-first-1: done before, skipped' in capsys.readouterr().out and (out/'search-first-1'/'run.json').read_text() == rec

@pytest.mark.slow
def test_a_final_training_of_another_cell_is_refused(done, tmp_path, capsys):
    "The selection changed after the final training ran (say, --override with more seeds): the study says to delete it"
    from rnn_darts.genotypes import DARTS_V1, genotype_to_dict
    d, s, _ = done
    s2 = tmp_path/'s'; shutil.copytree(s, s2)
    rec = json.loads((s2/'final'/'run.json').read_text()); rec['settings']['genotype'] = json.dumps(genotype_to_dict(DARTS_V1))
    (s2/'final'/'run.json').write_text(json.dumps(rec))
    sel = table(s)[lambda df: df.selected].stage.iloc[0]
    fails(capsys, study_args(d, s2), f"{s2/'final'} trained another cell than the selected one ({sel})", f"delete {s2/'final'}", code=1)

def fails(capsys, argv, *parts, code=2):
    with pytest.raises(SystemExit) as e: cli.run_command(argv)
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert e.value.code == code and len(lines) == 1 and lines[0].startswith('rnn-darts: error: '), err
    for p in parts: assert p in lines[0], (p, lines[0])
    assert 'Traceback' not in out + err

def test_bad_study_settings_get_one_line(tmp_path, capsys):
    p = ini(tmp_path)
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--methods', 'first,sgd'), '--methods', "'sgd'")
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--seeds', '1,one'), '--seeds must be whole numbers')
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--references', 'DARTS_V3'), '--references', 'DARTS_V3')
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--search-preset', 'nope'), '--search-preset', 'no preset [nope]')
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--stage', 'search-first-9'), '--stage search-first-9', 'search-first-1, search-random-1')
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--short-epochs', '0'), '--short-epochs')
    p.write_text(TINY.replace('short_epochs = 1', 'short_epoch = 1'))
    fails(capsys, study_args(tmp_path, tmp_path/'a'), str(p), '[tiny-study]', "'short_epoch'", code=2)
    p.write_text(TINY.replace('seeds = 1', 'seeds = 1,1'))
    fails(capsys, study_args(tmp_path, tmp_path/'a'), f"{p}: [tiny-study] seeds names 1 twice")
    p.write_text(TINY.replace('eval_bs = 4\ntest_bs = 4', 'eval_bs = 0\ntest_bs = 4'))   # a bad value in the train preset: found before any search runs
    fails(capsys, study_args(tmp_path, tmp_path/'a'), 'stage short-search-first-1: ', f"{p}: [tiny-train] eval_bs")
    p.write_text(TINY)
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--data', str(tmp_path/'nowhere')), str(tmp_path/'nowhere'), code=1)
    from rnn_darts.genotypes import DARTS_V2, save_genotype
    for x in 'xy': (tmp_path/x).mkdir(); save_genotype(DARTS_V2, tmp_path/x/'cell.json')
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--references', f"{tmp_path/'x'/'cell.json'},{tmp_path/'y'/'cell.json'}"),
          '--references', 'stage folder short-cell')
    run = tmp_path/'run'; run.mkdir(); (run/'run.json').write_text(json.dumps(dict(command='search', settings={})))
    fails(capsys, study_args(tmp_path, run), f"--out {run} is the run folder of an rnn-darts search")
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--stage', 'final', '--ray'), '--stage runs one stage here, --ray runs them all')
    with socket.socket() as sk: sk.bind(('127.0.0.1', 0)); port = sk.getsockname()[1]   # where nothing listens
    if importlib.util.find_spec('ray') is not None:
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--ray', f'127.0.0.1:{port}'), f'--ray 127.0.0.1:{port}: no Ray cluster answers there', code=1)
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--ray', 'head-node'), '--ray head-node: give a Ray cluster\'s address as HOST:PORT', code=2)
    with pytest.MonkeyPatch.context() as mp:                          # Ray is an optional extra
        mp.setitem(sys.modules, 'ray', None)
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--ray'), "--ray needs Ray", "pip install 'rnn-darts[ray]'", code=1)
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--select', 'asha'), "--select asha runs the trials on Ray Tune", "pip install 'rnn-darts[ray]'", code=1)
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--select', 'best'), '--select', "'best'")
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--random-cells', '4'), "--random-cells is a setting of ASHA's selection: give --select asha too")
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--at-once', '1'), "--at-once is a setting of ASHA's selection")
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--rungs', '1,3'), "--rungs is a setting of ASHA's selection")
    fails(capsys, study_args(tmp_path, tmp_path/'a', '--random-cells', '-1', '--select', 'asha'), '--random-cells')
    if importlib.util.find_spec('ray') is not None and importlib.util.find_spec('pyarrow') is not None:
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--select', 'asha', '--rungs', '1,3,8'), '--rungs: each rung is the one before times the same integer')
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--select', 'asha', '--short-epochs', '5'), "--short-epochs is the short trainings' length")
        save_genotype(DARTS_V2, tmp_path/'random-2.json')
        fails(capsys, study_args(tmp_path, tmp_path/'a', '--select', 'asha', '--random-cells', '2', '--references', str(tmp_path/'random-2.json')),
              '--references', "ASHA's trial folder random-2, which another cell has")
    assert not (tmp_path/'a').exists() and not (run/'study.json').exists()   # nothing was written

def test_an_address_where_no_ray_answers_is_one_line_at_once():
    """`--ray HOST:PORT` where something listens that is not Ray (Ray itself would retry there for minutes, printing
    warnings): refused after one silent wait; a server that answers HTTP/2's preface as gRPC (Ray's GCS) passes"""
    from rnn_darts.core import UserError
    from rnn_darts.study import check_answers
    def serve(reply:bytes):
        srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)
        def answer():
            c, _ = srv.accept()
            with c, contextlib.suppress(ConnectionResetError):   # the probe may hang up first
                c.recv(64); c.sendall(reply); c.recv(64)
        threading.Thread(target=answer, daemon=True).start()
        return srv, f"127.0.0.1:{srv.getsockname()[1]}"
    srv, addr = serve(b'')   # listens, says nothing
    with srv, pytest.raises(UserError, match=f"--ray {addr}: something listens there, but not a Ray cluster"): check_answers(addr, timeout=0.5)
    srv, addr = serve(b'HTTP/1.1 400 Bad Request\r\n\r\n')   # another server
    with srv, pytest.raises(UserError, match='not a Ray cluster'): check_answers(addr, timeout=0.5)
    srv, addr = serve(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))   # a SETTINGS frame: an HTTP/2 (gRPC) server
    with srv: check_answers(addr, timeout=5)

def test_a_study_on_ray_says_where_its_running_stages_stand(tmp_path):
    "The progress line of a study on Ray: each stage under way with its epochs logged of its total, where it resumed, and how many wait"
    from rnn_darts.study import Stage, running_text, epochs_logged
    a, b, c = Stage('search-first-1', 'search', 'first', 1), Stage('search-first-2', 'search', 'first', 2), Stage('final', 'final')
    for st, rows in ((a, 2), (b, 1)):
        (tmp_path/st.name).mkdir()
        (tmp_path/st.name/'run.json').write_text(json.dumps(dict(command='search', settings=dict(epochs=4))))
        (tmp_path/st.name/'log.csv').write_text('epoch,train_loss\n' + ''.join(f'{i},1.0\n' for i in range(rows)))
    assert [epochs_logged(tmp_path/x) for x in (a.name, b.name, 'nowhere')] == [2, 1, 0]
    assert running_text([a, b, c], tmp_path, {a.name: 0, b.name: 1, c.name: 0}) == \
        "search-first-1 epoch 2/4, search-first-2 epoch 1/4 (resumed after 1), 1 waiting"

def test_packaged_presets_plan_the_protocol():
    from rnn_darts.study import study_settings, check_study, plan_stages
    s, src = study_settings('study-paper', ROOT/'settings.ini')
    assert (s['data'], s['short_epochs'], s['final_epochs']) == ('ptb', 300, 3600)
    names = [x.name for x in plan_stages(check_study(s, src))]
    assert len(names) == 3 * 4 * 2 + 2 and names[0] == 'search-second-1' and names[-2:] == ['short-DARTS_V2', 'final']
    s, src = study_settings('study-quick', ROOT/'settings.ini')
    assert len(plan_stages(check_study(s, src))) == 3 * 2 * 2 + 2

def test_a_study_of_the_darts_family_plans_a_search_of_each_method(tmp_path):
    "Every method of the family is a study's method: its searches and short trainings planned by name (each method's fit, kill and resume: tests/test_resume.py; a study's kill and resume: above)"
    from rnn_darts.study import study_settings, check_study, plan_stages
    from rnn_darts.config import FAMILY
    family = list(FAMILY)
    (tmp_path/'settings.ini').write_text(TINY + f"\n[family-study]\nmethods = {','.join(family)}\nseeds = 1\nreferences = DARTS_V2\n"
                                         "search_preset = tiny-search\ntrain_preset = tiny-train\nshort_epochs = 1\nfinal_epochs = 1\n")
    s, src = study_settings('family-study', tmp_path/'settings.ini')
    names = [x.name for x in plan_stages(check_study(s, src))]
    assert len(family) >= 9
    assert names == [f'search-{m}-1' for m in family] + [f'short-search-{m}-1' for m in family] + ['short-DARTS_V2', 'final']


# --- on Ray (issue 56): a local Ray with this machine's 2 CPUs, started by the command; a cluster of our own for the mount test
needs_ray = pytest.mark.skipif(importlib.util.find_spec('ray') is None, reason="ray is not installed (pip install -e '.[dev]' installs it)")
NO_TOKEN = {'RAY_AUTH_MODE': 'disabled'}   # the test's own cluster, started and joined without Ray's token files

def starts(out, stage) -> int:
    "How many times a Ray worker started the stage (its log has a line as each starts)"
    return sum(l.startswith('== ') for l in (Path(out)/'ray-logs'/f'{stage}.log').read_text().splitlines())

def finished(folder) -> bool:
    p = Path(folder)/'run.json'
    return p.is_file() and bool(json.loads(p.read_text()).get('finished'))

@pytest.mark.slow
@needs_ray
def test_on_ray_a_killed_worker_and_a_killed_driver_give_the_same_table(done, tmp_path):
    """--ray on a local Ray with 2 CPUs. A worker SIGKILLed after search-first-1's third batch is run again by Ray (and
    does not hold again); then the driver is SIGKILLed with its Ray (its process group) after three stages; the same
    command again runs the rest, nothing twice, and study.csv is the study run without Ray, bit for bit at one thread a stage"""
    d, s, _ = done
    out = tmp_path/'s'
    job = Job(study_args(d, out, '--ray'), hold='search-first-1 batch 3', tmp=tmp_path, group=True)
    job.signal(signal.SIGKILL, to=job.held())                         # the worker, inside the stage
    job.wait_line('[3/6]')
    with contextlib.suppress(ProcessLookupError): job.signal(signal.SIGKILL, to='group')
    job.finish(60)
    assert starts(out, 'search-first-1') == 2, job.said                # Ray ran it again after its worker died
    ended = {st: (out/st/'run.json').read_text() for st in STAGES if finished(out/st)}
    assert len(ended) >= 3
    again = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *study_args(d, out, '--ray')], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=600)
    assert again.returncode == 0, again.stderr
    skipped = {st for st in STAGES if f"study {st}: done before, skipped" in again.stdout}
    ran = {st for st in STAGES if f"] {st}: done; best validation perplexity " in again.stdout}
    assert all(f"study {st}: starts" in again.stdout or f"study {st}: resumes after epoch " in again.stdout for st in ran), again.stdout   # a line as each begins on a worker
    assert set(ended) <= skipped and not skipped & ran and skipped | ran == set(STAGES), again.stdout   # a stage the killed Ray's workers ended meanwhile is kept too
    assert all((out/st/'run.json').read_text() == rec for st, rec in ended.items())   # not run twice
    pd.testing.assert_frame_equal(table(out), table(s))

@pytest.mark.slow
@needs_ray
def test_the_ptb_study_preset_runs_end_to_end_through_ray_at_a_tiny_size(tmp_path):
    """(#68) The shipped study-ptb preset on a folder laid out as the shared Penn Treebank (valid.txt and test.txt
    only): each stage trains on valid.txt and validates and tests on test.txt's halves, unknown words mapped to <unk>;
    both its references; through --ray. Tiny sizes, and 3 of its methods at one seed for the suite's time (the
    others' fits: test_family.py); their ops a user's, through --import on Ray's workers. Every number in study.csv is finite"""
    import configparser
    shipped = configparser.ConfigParser(); shipped.read(ROOT/'settings.ini')
    p = dict(shipped['study-ptb'])
    assert (p['files'], p['unk'], p['references']) == ('valid.txt,test.txt:1/2,test.txt:2/2', '<unk>', 'DARTS_V2,ENAS')
    assert p['methods'].split(',') == ['darts', 'first', 'gdas', 'snas', 'drnas', 'milenas', 'beta-darts', 'sdarts-rs', 'sdarts-adv', 'darts-pt', 'fair-darts', 'random']
    p.update(methods='darts,gdas,random', seeds='1', search_preset='tiny-swish', train_preset='tiny-train', short_epochs='1', final_epochs='1')
    swish = TINY.split('[tiny-train]')[0].replace('[tiny-search]', '[tiny-swish]') + 'ops = tanh,swish\n'   # a user's op: Ray's workers import it too
    (tmp_path/'settings.ini').write_text(TINY + swish + '\n[ptb-tiny]\n' + ''.join(f'{k} = {v}\n' for k, v in p.items()))
    (tmp_path/'plugin.py').write_text("import torch\nfrom rnn_darts.ops import register_op\nregister_op('swish', lambda x: x * torch.sigmoid(x))\n")
    penn = tmp_path/'penn'; penn.mkdir()
    words = 'zero one two three four five six seven eight nine ten'.split()
    line = lambda i: ' '.join(words[(i * j) % 11] for j in range(1, 8))
    (penn/'valid.txt').write_text(''.join(line(i) + '\n' for i in range(220)))
    (penn/'test.txt').write_text(''.join(line(i) + (' eleven' if i % 7 == 0 else '') + '\n' for i in range(180)))   # words the train split lacks
    out = tmp_path/'s'
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', 'study', '--preset', 'ptb-tiny', '--settings', str(tmp_path/'settings.ini'),
                        '--data', str(penn), '--out', str(out), '--device', 'cpu', '--threads', '1', '--ray', '--import', str(tmp_path/'plugin.py')], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(out/'study.csv')
    assert df['stage'].tolist() == ['short-search-darts-1', 'short-search-gdas-1', 'short-search-random-1', 'short-DARTS_V2', 'short-ENAS'], df
    raw = pd.read_csv(out/'study.csv', dtype=str, keep_default_na=False)   # as written: '' is an empty cell, 'nan' a NaN
    empty = raw == ''   # what does not apply: a reference's search time, the final results of the cells not selected
    assert empty['search_seconds'].tolist() == [False] * 3 + [True] * 2 and (empty['final_test_ppl'] == ~df['selected']).all(), raw
    cols = ['seed', 'search_seconds', 'short_valid_loss', 'short_valid_ppl', 'final_valid_ppl', 'final_test_ppl']
    assert all(math.isfinite(float(v)) for c in cols for v in raw[c] if v != '') and df['selected'].sum() == 1, raw   # every number written is finite
    assert json.loads((out/'search-darts-1'/'run.json').read_text())['imports'][0]['name'] == str(tmp_path/'plugin.py')
    assert 'swish' in json.loads((out/'search-random-1'/'genotype.json').read_text())['ops']
    data = json.loads((out/'search-darts-1'/'run.json').read_text())['data']
    assert [data[s]['file'] for s in ('train', 'valid', 'test')] == [f'{penn}/valid.txt', f'{penn}/test.txt:1/2', f'{penn}/test.txt:2/2']

STOPPED = "the running stages stopped, each at a checkpoint it can resume from; resume the study with: rnn-darts"

@pytest.mark.slow
@needs_ray
@pytest.mark.parametrize('sig, to', [(signal.SIGINT, 'group'), (signal.SIGTERM, None)], ids=['ctrl-c', 'sigterm'])
def test_on_ray_ctrl_c_stops_the_stages_and_says_how_to_resume(done, tmp_path, sig, to):
    """Ctrl-C in the terminal (SIGINT to the command's process group, its Ray included), or SIGTERM to the driver, while
    search-first-1 is held after its third batch: that stage stops there, at a mid-epoch checkpoint, one line says to run
    the same command again, exit 130 (143); that command ends with the study's table (run after Ctrl-C only: both stop the stages alike)"""
    d, s, _ = done
    out = tmp_path/'s'
    job = Job(study_args(d, out, '--ray'), hold='search-first-1 batch 3', tmp=tmp_path, group=True)
    job.held()
    job.signal(sig, to=to)
    code, _, err = job.finish(300)   # a guard against a hang, not a wait: on CI's loaded cores the stages' ending took over 120 s
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 128 + sig and lines == [f"rnn-darts: {'interrupted' if sig == signal.SIGINT else 'SIGTERM'}: {STOPPED} {shlex.join(study_args(d, out, '--ray'))}"], err
    assert load_checkpoint(out/'search-first-1'/'checkpoints'/'mid_epoch.pth')['mid']['batches'] == 3
    said = (out/'ray-logs'/'search-first-1.log').read_text().strip().splitlines()[-1]   # the stage's own line names the study command
    assert said.startswith('rnn-darts: SIGINT at epoch 0, after batch 3 of ') and said.endswith(f"resume with: rnn-darts {shlex.join(study_args(d, out, '--ray'))}"), said
    assert not finished(out/'final')
    if sig == signal.SIGTERM: return
    again = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *study_args(d, out, '--ray', *BOARD(tmp_path))], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=600)
    assert again.returncode == 0, again.stderr
    pd.testing.assert_frame_equal(table(out), table(s))
    if HAS_TB: assert board_epochs(tmp_path/'tb'/'final') == [0, 1]   # a stage on Ray writes its run where the driver said

@pytest.mark.slow
@needs_ray
def test_on_ray_a_stage_failing_for_the_user_is_not_run_again(done, tmp_path):
    "The final training finds the selection changed (the user's reason): one line naming the stage, exit 1, and Ray does not run it again"
    from rnn_darts.genotypes import DARTS_V1, genotype_to_dict
    d, s, _ = done
    s2 = tmp_path/'s'; shutil.copytree(s, s2)
    rec = json.loads((s2/'final'/'run.json').read_text()); rec['settings']['genotype'] = json.dumps(genotype_to_dict(DARTS_V1))
    (s2/'final'/'run.json').write_text(json.dumps(rec))
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *study_args(d, s2, '--ray')], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=300)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith('rnn-darts: error: stage final: ') and 'trained another cell than the selected one' in lines[0]
    assert starts(s2, 'final') == 1 and r.stdout.count('done before, skipped') == len(STAGES) - 1

def _can_unshare() -> bool:
    try: return subprocess.run(['unshare', '-m', 'true'], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired): return False

@pytest.mark.slow
@needs_ray
@pytest.mark.skipif(not _can_unshare(), reason="unshare -m is not permitted here: no mount namespace for a worker's own view of the folder")
def test_on_ray_a_worker_that_cannot_write_the_study_folder_gets_one_line(tmp_path):
    """A cluster whose workers see the study folder read-only (a read-only bind mount in their own mount namespace), as a
    node without the shared filesystem would: one line, exit 1, before any stage runs"""
    ini(tmp_path); out = tmp_path/'s'; out.mkdir()
    with socket.socket() as sk: sk.bind(('127.0.0.1', 0)); port = sk.getsockname()[1]
    ray_cli = Path(sys.executable).parent/'ray'
    head = subprocess.Popen(['unshare', '-m', '--propagation', 'private', 'sh', '-c',
                             f"mount --bind {out} {out} && mount -o remount,bind,ro {out} && exec {ray_cli} start --head --port {port} "
                             f"--num-cpus 1 --include-dashboard false --disable-usage-stats --block"],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **NO_TOKEN})
    try:
        t = time.time()
        while time.time() - t < 90:
            with contextlib.suppress(OSError): socket.create_connection(('127.0.0.1', port), timeout=1).close(); break
            time.sleep(0.5)
        r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *study_args(tmp_path, out, '--ray', f'127.0.0.1:{port}')], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, 'PYTHONPATH': str(ROOT), **NO_TOKEN}, timeout=300)
    finally:
        head.terminate()
        try: head.wait(timeout=30)
        except subprocess.TimeoutExpired: pass
        with contextlib.suppress(ProcessLookupError): os.killpg(head.pid, signal.SIGKILL)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0] == f"rnn-darts: error: a Ray worker on {socket.gethostname()} cannot write in the study folder --out {out}: Read-only file system"
    assert not any(p.name.startswith('search-') for p in out.iterdir())   # no stage ran

needs_tune = pytest.mark.skipif(importlib.util.find_spec('ray') is None or importlib.util.find_spec('pyarrow') is None,
                                reason="Ray Tune is not installed (pip install 'rnn-darts[ray]')")

@pytest.mark.slow
@needs_tune
def test_a_tiny_pool_under_asha_chooses_the_best_cell_of_the_last_rung(tmp_path, monkeypatch):
    """DARTS_V2 and 3 random cells, rungs 1,2, on a corpus folder named relative to the current folder (Tune runs each
    trial in a folder of its own): each trial's run folder logs the epochs it reached; the chosen cell reached 2 and is the best there"""
    from rnn_darts.asha import asha_pool, select_asha
    from rnn_darts.options import code_defaults
    words = 'zero one two three four five six seven eight nine'.split()
    (tmp_path/'corpus').mkdir()
    for split, n in (('train', 200), ('valid', 60), ('test', 60)):
        (tmp_path/'corpus'/f'{split}.txt').write_text(''.join(' '.join(words[(i * j + n) % 10] for j in range(1, 8)) + '\n' for i in range(n)))
    monkeypatch.chdir(tmp_path)
    s = {**code_defaults('train'), **dict(data='corpus', bs=8, bptt=10, eval_bs=4, emsize=16, nhid=16, seed=3, threads=1)}
    pool = asha_pool(dict(DARTS_V2='DARTS_V2'), n_random=3, seed=1)
    chosen, table = select_asha(pool, s, rungs='1,2', out=tmp_path/'asha')
    import ray
    assert not ray.is_initialized()   # the local Ray it started is gone: no raylet or idle workers slow what runs next
    assert sorted(table.cell) == sorted(pool) and set(table.epochs) <= {1, 2}
    top = table[table.epochs == 2]
    assert chosen == top.cell[top.valid_ppl.idxmin()]
    for _, r in table.iterrows():
        run = tmp_path/'asha'/r.cell
        assert len((run/'log.csv').read_text().splitlines()) == 1 + r.epochs   # the epochs it reached, no more
        assert json.loads((run/'run.json').read_text())['genotype']['recurrent'] == [list(x) for x in pool[r.cell].recurrent]

ASHA = ['--select', 'asha', '--random-cells', '2', '--rungs', '1,2', '--at-once', '1']   # one trial at a time: the same choice on every run
POOL = ['search-first-1', 'search-random-1', 'random-1', 'random-2', 'DARTS_V2']           # the trials in the order Tune starts them

def run_cli(argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=timeout)

@pytest.fixture(scope='module')
def asha_done(tmp_path_factory):
    "An uninterrupted tiny study that chooses by ASHA, run as a user runs it: (folder of its settings, study folder, stdout)"
    d = tmp_path_factory.mktemp('asha'); ini(d)
    r = run_cli(study_args(d, d/'s', *ASHA))
    assert r.returncode == 0, r.stderr
    return d, d/'s', r.stdout

def logged_ppl(run) -> list:
    return [math.exp(float(r['valid_loss'])) for r in pd.read_csv(Path(run)/'log.csv', dtype=str).to_dict('records')]

def asha_promoted(values:list, eta:int) -> list:
    "A plain ASHA rung (Li et al., algorithm 2, as Tune cuts it): in order of arrival, a trial goes on unless its perplexity is worse than the (1 - 1/η) quantile of those before it"
    import numpy as np
    seen, out = [], []
    for v in values:
        out.append(bool(not seen or -v >= np.nanpercentile(seen, (1 - 1 / eta) * 100)))
        seen.append(-v)
    return out

@pytest.mark.slow
@needs_tune
def test_a_study_chooses_by_asha_among_searched_random_and_reference_cells(asha_done, capsys):
    """--select asha with 2 random cells, rungs 1,2 (η 2): every cell of the pool is a trial; those a plain ASHA rung
    promotes, and only those, train to epoch 2; the chosen cell is the best there (the reference never chosen), the final
    training trains it, study.csv and the report say so, and the same command again runs nothing"""
    d, s, said = asha_done
    df = pd.read_csv(s/'study.csv')
    assert df.stage.tolist() == [f'asha/{n}' for n in df.stage.str[5:]] and sorted(df.stage.str[5:]) == sorted(POOL)
    first = {n: logged_ppl(s/'asha'/n) for n in POOL}
    went_on = asha_promoted([first[n][0] for n in POOL], eta=2)
    assert [len(first[n]) for n in POOL] == [2 if w else 1 for w in went_on]   # Tune's decisions are the rule's
    for _, r in df.iterrows():
        assert r.asha_epochs == len(first[r.stage[5:]]) and r.asha_valid_ppl == pytest.approx(first[r.stage[5:]][-1], rel=1e-12)
    assert df.set_index('stage').method.to_dict() == {'asha/search-first-1': 'first', 'asha/search-random-1': 'random', 'asha/random-1': 'sampled',
                                                       'asha/random-2': 'sampled', 'asha/DARTS_V2': 'reference'}
    top = df[(df.method != 'reference') & (df.asha_epochs == 2)]
    assert df.selected.sum() == 1 and df[df.selected].stage.item() == top.stage[top.asha_valid_ppl.idxmin()]
    final = json.loads((s/'final'/'run.json').read_text())
    assert load_genotype(final['settings']['genotype']) == load_genotype(df[df.selected].genotype.item()) and final['finished']
    assert df[df.selected].final_test_ppl.notna().all() and df[~df.selected].final_test_ppl.isna().all()
    assert f"ASHA rung 1/2 (epoch 1) filled: 5 trials, {sum(went_on)} promoted, {5 - sum(went_on)} stopped; best " in said
    assert f"ASHA rung 2/2 (epoch 2) filled: {sum(went_on)} trial{'s' * (sum(went_on) > 1)} trained to the last rung" in said
    cli.run_command(['report', str(s)])
    assert (s/'report'/'rungs.png').is_file() and '## The rungs' in (s/'report'/'report.md').read_text()
    again = run_cli(study_args(d, s, *ASHA))
    assert again.returncode == 0 and again.stdout.count('done before, skipped') == 4, again.stdout + again.stderr

ASHA_STOPPED = "the running trials stopped, each at a checkpoint it can resume from; resume the study with: rnn-darts"

@pytest.mark.slow
@needs_tune
@pytest.mark.parametrize('sig, to', [(signal.SIGINT, None), (signal.SIGTERM, None)], ids=['ctrl-c', 'sigterm'])
def test_asha_ctrl_c_stops_the_trials_at_a_checkpoint_and_the_same_command_finishes(asha_done, tmp_path, sig, to):
    """SIGINT (Ctrl-C; to the driver only: in a fresh-clone run of the suite, SIGINT to the whole group, Ray's own
    processes included, left the study on Ray's Ctrl-C test and this one hanging), or SIGTERM to the driver, while the
    trial of random-1 is held after its third batch: it stops there at a mid-epoch checkpoint, one line says to run the
    same command again, exit 130 (143); after Ctrl-C that command ends with the uninterrupted study's table, and every
    trial's log is the uninterrupted one's, bit for bit but for its epochs' wall times"""
    d, s, _ = asha_done
    out = tmp_path/'s'
    job = Job(study_args(d, out, *ASHA), hold='random-1 batch 3', tmp=tmp_path, group=True)
    job.held()
    job.signal(sig, to=to)
    code, _, err = job.finish(300)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 128 + sig and lines == [f"rnn-darts: {'interrupted' if sig == signal.SIGINT else 'SIGTERM'}: {ASHA_STOPPED} {shlex.join(study_args(d, out, *ASHA))}"], err
    assert load_checkpoint(out/'asha'/'random-1'/'checkpoints'/'mid_epoch.pth')['mid']['batches'] == 3
    if sig == signal.SIGTERM: return
    again = run_cli(study_args(d, out, *ASHA))
    assert again.returncode == 0, again.stderr
    pd.testing.assert_frame_equal(table(out), table(s))
    for n in POOL: pd.testing.assert_frame_equal(pd.read_csv(out/'asha'/n/'log.csv').drop(columns='time'), pd.read_csv(s/'asha'/n/'log.csv').drop(columns='time'))

@pytest.mark.slow
@needs_tune
def test_asha_on_ray_a_killed_trial_is_retried_from_its_checkpoint(asha_done, tmp_path):
    """With --ray (the searches and the final training Ray tasks, ASHA's trials from the driver): the first trial (always
    promoted: it trains 2 epochs) is SIGKILLed in its second epoch; Tune starts it again, it resumes from its first
    epoch's checkpoint, and the study ends with the uninterrupted one's table"""
    d, s, _ = asha_done
    out = tmp_path/'s'
    job = Job(study_args(d, out, *ASHA, '--ray'), hold='search-first-1 batch 25', tmp=tmp_path, group=True)   # a trial's epoch is 18 batches, the search's 1 epoch too
    job.signal(signal.SIGKILL, to=job.held())
    code, said, err = job.finish(300)
    assert code == 0, err
    assert 'study: 2 stages on Ray' in said and 'study: 1 stage on Ray' in said, said   # the searches, then the final training
    said = (out/'asha'/'search-first-1.log').read_text()
    assert said.count('\n== ') + said.startswith('== ') == 2 and 'resumed from ' in said and 'epoch_0000.pth' in said, said
    pd.testing.assert_frame_equal(table(out), table(s))
