"""Multi-process training (rnn_darts.distrib) with 2 CPU processes and gloo: one step equals one process at the same global batch, a short search keeps the ranks identical, resume across world sizes, no hang when a rank dies.

The checks of a healthy group share one launch (`group`: `_distrib_cases.one_group`), since each launch costs two imports
of torch and fastai; each part comes back with its own value or error, so a failing part fails its own tests by name.
A dying or hanging rank breaks its group: those two cases launch a group each."""
import os, shutil, time
import pytest, torch, torch.nn.functional as F
from rnn_darts.distrib import spawn_distrib, distrib_learner, DistribFlat
from rnn_darts.callbacks.checkpoint import load_checkpoint, restore
from tests import _distrib_cases as C

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('distrib'), pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]
close = lambda a, b, tol: torch.testing.assert_close(a, b, atol=tol, rtol=0)
cos = lambda a, b: F.cosine_similarity(a.flatten(), b.flatten(), 0).item()

@pytest.fixture(scope='module')
def group(tmp_path_factory):
    "One 2-process launch doing every healthy-group check; with the one-process run the resume continues (made first: its checkpoint is the 2-process resume's start)"
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp('distrib')
    a, b, ref = tmp/'search', tmp/'resumed', tmp/'reference'
    # one process: 1 epoch with checkpoints (BN off, first order), copied; continued to 2 epochs in one process
    learn = C.build('search', 'first', 'off', path=ref, checkpoint=True, n_train=C.SMALL)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    shutil.copytree(ref, b)
    cont = C.short_search(str(ref), epochs=2, mode='first', bn='off', resume=True)
    res = spawn_distrib(C.one_group, 2, args=(str(a), str(b)), timeout=900)
    return [r['value'] for r in res], cont, a, b

def part(group, name):
    "Both ranks' values of one part of the launch; its error (with the rank's traceback) if it failed"
    outs = [g[name] for g in group[0]]
    errors = [f"rank {r}, part {name!r}: {o['error']}" for r, o in enumerate(outs) if not o['ok']]
    assert not errors, '\n'.join(errors)
    return [o['value'] for o in outs]

@pytest.fixture(scope='module')
def steps(group):
    r0, r1 = part(group, 'steps')
    ref = {c: C.one_step(*c) for c in C.STEP_CASES}
    ghost = {c: C.one_step(c[0], c[1], 'ghost', c[3]) for c in C.STEP_CASES if c[2] == 'batch' and c[0] == 'search'}
    return r0, r1, ref, ghost

@pytest.mark.slow
def test_ranks_identical_after_step(steps):
    r0, r1, _, _ = steps
    for c in C.STEP_CASES:
        assert torch.equal(r0[c]['w'], r1[c]['w']), c
        if r0[c]['alpha'] is not None: assert torch.equal(r0[c]['alpha'], r1[c]['alpha']), c

def test_derived_step_matches_one_process(steps):
    "DartsRnn has no BatchNorm: world 2 at batch B == 1 process at batch B"
    r0, _, ref, _ = steps
    c = ('derived', 'first', 'batch', C.BS)
    close(r0[c]['w'], ref[c]['w'], 1e-5)

def test_first_order_step_matches_without_bn(steps):
    "Search cell, first order, BatchNorm off: weights, α and α's hypergradient match one process"
    r0, _, ref, _ = steps
    c = ('search', 'first', 'off', C.BS)
    close(r0[c]['w'], ref[c]['w'], 1e-5); close(r0[c]['alpha'], ref[c]['alpha'], 1e-6); close(r0[c]['g'], ref[c]['g'], 1e-7)

def test_step_is_one_process_with_per_rank_bn(steps):
    "With BatchNorm (per-rank statistics), world 2 == one process whose BN takes statistics over 2 blocks of B/2 rows"
    r0, _, _, ghost = steps
    for c in [('search', 'first', 'batch', C.BS), ('search', 'first', 'batch', C.BIG)]:
        close(r0[c]['w'], ghost[c]['w'], 1e-5); close(r0[c]['alpha'], ghost[c]['alpha'], 1e-5)
        close(r0[c]['g'], ghost[c]['g'], 1e-7)

def test_bn_difference_quantified(steps):
    "Against the plain one-process step (BN over all B rows) at B=32: the hypergradient differs by ~16% (cosine ~0.99)"
    r0, _, ref, _ = steps
    c = ('search', 'first', 'batch', C.BIG)
    g0, g1 = r0[c]['g'], ref[c]['g']
    assert cos(g0, g1) > 0.95 and (g0 - g1).norm() / g1.norm() < 0.3

def test_second_order_is_mean_of_per_rank_unrolled_hypergradients(steps):
    "Second order with 2 ranks = the mean of each rank's own unrolled hypergradient (its own w', its own clip)"
    r0, _, _, _ = steps
    close(r0[('search', 'second', 'batch', C.BS)]['g'], C.half_hypergrads(2, C.BS), 1e-7)

def test_second_order_approximation_quantified(steps):
    "BN off, B=32: the averaged per-rank hypergradient points the same way as the one-process one (cos > 0.999), its norm differs by ~11%; Adam's step normalises that away"
    r0, _, ref, _ = steps
    c = ('search', 'second', 'off', C.BIG)
    g0, g1 = r0[c]['g'], ref[c]['g']
    assert cos(g0, g1) > 0.999 and 0.75 < (g0.norm() / g1.norm()).item() < 1.25
    assert ((r0[c]['alpha'] - ref[c]['alpha']).abs() < 1e-5).float().mean() > 0.95
    close(r0[c]['w'], ref[c]['w'], 1e-4)

@pytest.fixture(scope='module')
def runs(group):
    r0, r1 = part(group, 'runs')
    _, cont, a, b = group
    return r0, r1, cont, a, b

@pytest.mark.slow
def test_short_search_ranks_identical(runs):
    r0, r1, _, a, _ = runs
    s0, s1 = r0['search'], r1['search']
    assert torch.equal(s0['alpha'], s1['alpha']) and torch.equal(s0['w'], s1['w'])
    assert all(torch.equal(x, y) for x, y in zip(s0['buffers'], s1['buffers']))   # BN running stats synced
    assert s0['valid'] == s1['valid'] and len(s0['valid']) == 2
    assert not torch.equal(s0['streams'], s1['streams'])                        # each rank its own streams
    assert 'epoch_0001.pth' in s0['files'] and 'best.pth' in s0['files']

def test_resume_one_to_two_processes(runs):
    "A 1-process checkpoint resumed by 2 processes continues like the 1-process run (BN off: up to rounding)"
    r0, r1, cont, _, b = runs
    x = r0['resumed']
    assert torch.equal(x['alpha'], r1['resumed']['alpha'])
    close(x['w'], cont['w'], 1e-4); close(x['alpha'], cont['alpha'], 1e-4)
    # and the 2-process checkpoint loads into one process
    learn = C.build('search', 'first', 'off', path=b, n_train=C.SMALL)
    restore(learn, load_checkpoint(b/'checkpoints'/'epoch_0001.pth'))
    assert torch.equal(learn.model.flat.data, x['w']) and torch.equal(learn.model.alpha.detach(), x['alpha'])

@pytest.mark.slow
def test_random_search_ranks_draw_the_same_cells(group):
    "--mode random on 2 processes: every rank runs the same cell at every batch (those one process draws), and the ranks' weights stay equal"
    torch.set_num_threads(1)
    a, b = part(group, 'random')
    assert a['cells'] == b['cells'] and len(set(a['cells'])) > 10 and torch.equal(a['w'], b['w'])
    assert C.random_fit()['cells'] == a['cells']

@pytest.mark.slow
def test_ranks_leave_the_group_together(group):
    "`cleanup_distrib` waits for every rank (no rank tears its connections down while rank 0 still writes); `barrier=False` (after a failure) does not. The group's last part: it left with the barrier, then rejoined a new group and left without"
    (with0, without0), (with1, without1) = part(group, 'leave')
    # time is the property: a barrier's wait shows only as time. Rank 0 arrives 1 s late (`leave_after`); each bound has 0.3 s or more of margin
    waited = [with0, with1]
    assert waited[1] > 0.8 and waited[0] < 0.5, waited
    waited = [without0, without1]
    assert max(waited) < 0.5, waited

@pytest.mark.slow
@pytest.mark.parametrize('how', ['die', 'hang'])
def test_failed_rank_does_not_hang(how):
    "Rank 1 dies or hangs: rank 0 stops with a DistribError naming the exchange, within the timeout, and no one waits forever"
    t0 = time.time()   # time is the property (no rank waits for ever): the hung rank sleeps 600 s, the group's timeout is 5 s
    res = spawn_distrib(C.die_or_hang, 2, args=(how,), timeout=120, pg_timeout=5, grace=10, check=False)   # grace: room for a loaded machine to report
    assert time.time() - t0 < 60
    assert not res[0]['ok'] and 'DistribError' in res[0]['error'] and 'rank 0 of 2' in res[0]['error'], res[0]
    assert 'all-reduce' in res[0]['error']
    assert not res[1]['ok'] and res[1]['exitcode'] != 0

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs two or more GPUs")
def test_nccl_ranks_identical_and_equal_to_one_gpu_process():
    "On two GPUs in an NCCL group: the ranks stay identical after a step, and the derived cell's step is one GPU process's at the same global batch"
    r0, r1 = (r['value'] for r in spawn_distrib(C.step_cases, 2, args=('cuda',), timeout=600, device='cuda'))
    for c in C.STEP_CASES:
        assert torch.equal(r0[c]['w'], r1[c]['w']), c
        if r0[c]['alpha'] is not None: assert torch.equal(r0[c]['alpha'], r1[c]['alpha']), c
    c = ('derived', 'first', 'batch', C.BS)
    close(r0[c]['w'].cpu(), C.one_step(*c, device='cuda')['w'].cpu(), 1e-5)

def test_spawn_distrib_refuses_an_unknown_device():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"): spawn_distrib(C.step_cases, 2, device='tpu')
