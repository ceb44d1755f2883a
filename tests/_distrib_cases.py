"""Helpers for tests/test_distrib.py: tiny learners and the functions each spawned rank runs (importable by spawn)."""
import os, shutil, traceback
import torch, torch.nn.functional as F
from fastai.callback.core import Callback, CancelFitException
from rnn_darts.data import numbers_corpus
from rnn_darts.distrib import distrib_learner, rank_world, setup_distrib, _free_port
from rnn_darts.callbacks.arch import hypergrad_second
from tests._learners import tiny_learner, NODROP

BS, BPTT, NHID = 4, 6, 8

def set_norm(model, bn, groups=2):
    "bn: 'batch' (the model's BatchNorm), 'off' (identity) or 'ghost' (batch statistics over `groups` row blocks)"
    cell = getattr(model, 'cell', None)
    if bn == 'batch' or not hasattr(cell, 'bn'): return
    if bn == 'off': cell.norm = lambda s, i, update_stats=True: s; return
    def norm(s, i, update_stats=True):
        if not cell.training: return cell.bn(s, i)
        return torch.cat([F.batch_norm(h, None, None, training=True, eps=cell.bn.eps) for h in s.chunk(groups)])
    cell.norm = norm

def corpus(n_train=1500): return numbers_corpus(0, n_train, 600, 300)

def build(kind='search', mode='first', bn='batch', seed=0, path=None, checkpoint=False, resume=None, bs=BS, n_train=1500, device='cpu'):
    "A learner of the distributed cases (`kind` search, random, or a derived cell's training), its normalisation `bn`; λ_max, measured on each rank apart, is not the point here"
    search = kind in ('search', 'random')
    learn = tiny_learner('search' if search else 'train', corpus(n_train), path, seed=seed, bs=bs, bptt=BPTT, eval_bs=4, nhid=NHID,
                         device=device, checkpoint=checkpoint, resume=resume, quiet=False, lr=2. if bn == 'off' else 20.,   # without normalisation lr 20 diverges (NaN) in the first epoch
                         genotype='DARTS_V2', **NODROP, **(dict(mode='random' if kind == 'random' else mode) if search else {}))
    set_norm(learn.model, bn)
    return learn

class StopAfterFirstBatch(Callback):
    order = 99
    def after_batch(self): raise CancelFitException()

def state(learn, rec=None):
    m = learn.model
    return dict(w=m.flat.data.clone(), alpha=m.alpha.detach().clone() if hasattr(m, 'alpha') else None,
                g=rec[0] if rec else None, buffers=[b.clone() for b in m.buffers() if b.is_floating_point()])

def one_step(kind, mode='first', bn='batch', bs=BS, device='cpu'):
    "One training batch (architecture step + weight step) on this process's share; the weights, α and α's hypergradient"
    learn = distrib_learner(build(kind, mode, bn, bs=bs, device=device))
    rec, arch = [], getattr(learn, 'arch_param_update', None)
    if arch is not None:
        red = arch.reduce
        def record(g):
            g = red(g) if red is not None else g
            rec.append(g.clone()); return g
        arch.reduce = record
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=StopAfterFirstBatch())
    return state(learn, rec)

CASES = [('derived', 'first', 'batch'), ('search', 'first', 'batch'), ('search', 'first', 'off'),
         ('search', 'second', 'off'), ('search', 'second', 'batch')]

def one_steps(cases=None): return {c: one_step(*c) for c in (cases or CASES)}

def half_hypergrads(world=2, bs=BS, bn='batch'):
    "Mean over row blocks of the unrolled hypergradient at the first batch: what `world` ranks compute together (one process)"
    learn = build('search', 'second', bn, bs=bs)
    m, dl = learn.model, learn.dls.train
    i, sl = dl.schedule()[0]
    x, y = dl.data[:, i:i+sl], dl.data[:, i+1:i+1+sl]
    sx, sy = learn.arch_param_update.search_dl.next(sl)
    eta, k = learn.lr * sl / BPTT, bs // world
    m.train(); m.alpha.requires_grad_(True)
    gs = []
    with m.frozen_masks():
        for r in range(world):
            m.reset(); b = slice(r * k, (r + 1) * k)
            gs.append(hypergrad_second(m, (x[b], y[b]), (sx[b], sy[b]), eta, learn.wd, 0.25)[0])
    return torch.stack(gs).mean(0)

SMALL = 500   # training tokens of the short runs

def short_search(path, epochs=2, mode='second', bn='batch', resume=None, kind='search'):
    "A short fit; returns the final state, the recorded valid losses and the checkpoint files"
    learn = distrib_learner(build(kind, mode, bn, path=path, checkpoint=True, resume=resume, n_train=SMALL))
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs)
    res = state(learn)
    res.update(valid=[v[1] for v in learn.recorder.values], files=sorted(os.listdir(os.path.join(path, 'checkpoints'))),
               rank=rank_world()[0], streams=learn.dls.train.data.clone())
    return res

def die_or_hang(how, bad_rank=1):
    "Rank `bad_rank` dies (`how='die'`) or hangs (`how='hang'`) after setup; the others train"
    learn = distrib_learner(build('search', 'first'))
    if rank_world()[0] == bad_rank:
        if how == 'die': os._exit(3)
        import time; time.sleep(600)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    return 'finished'

def leave_after(delay_rank=0, delay=1.0, barrier=True):
    "Rank `delay_rank` waits `delay` s (as rank 0 does while it writes the run's files), then every rank leaves the group: the seconds each spent in `cleanup_distrib`"
    import time
    from rnn_darts.distrib import cleanup_distrib
    if rank_world()[0] == delay_rank: time.sleep(delay)
    t0 = time.perf_counter(); cleanup_distrib(barrier=barrier)
    return time.perf_counter() - t0

BIG = 32   # per-rank batch 16: BatchNorm statistics over 16 rows instead of 32
STEP_CASES = [('derived', 'first', 'batch', BS), ('search', 'first', 'off', BS), ('search', 'first', 'batch', BS),
              ('search', 'second', 'batch', BS), ('search', 'first', 'batch', BIG), ('search', 'second', 'off', BIG)]

def step_cases(device='cpu'): return {c: one_step(*c, device=device) for c in STEP_CASES}

def search_and_resume(search_path, resume_path):
    "A 2-epoch second-order search from scratch, and a first-order run resumed from a 1-process checkpoint in `resume_path`"
    a = short_search(search_path, epochs=2, mode='second', bn='batch')
    b = short_search(resume_path, epochs=2, mode='first', bn='off', resume=True)
    return dict(search=a, resumed=b)

class CellLog(Callback):
    "The cell of every training batch"
    order = 50
    def before_fit(self): self.cells = []
    def after_pred(self):
        if self.training: self.cells.append(self.model.genotype())

def random_fit():
    "A 1-epoch random search on this process's share of the streams: the cell of every batch, and the weights"
    learn, log = distrib_learner(build('random')), CellLog()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=log)
    return dict(cells=log.cells, w=learn.model.flat.data.clone())

def leave_twice(delay=1.0, tries=3):
    """`leave_after` with the barrier, then in a new group (on ports rank 0 picked and sent) without it: each's seconds on
    this rank. Joining a second gloo group in one process is this test's scaffolding, never a run's (a run joins once),
    and once in a CI run on 2 busy cores its mesh failed ('Connection closed by peer'): both ranks then fail alike, so
    both try the next port"""
    import torch.distributed as dist
    ports = [[_free_port() for _ in range(tries)] if rank_world()[0] == 0 else None]
    dist.broadcast_object_list(ports, src=0)
    waited = leave_after(0, delay, True)
    for i, port in enumerate(ports[0]):
        os.environ['MASTER_PORT'] = str(port)
        try: setup_distrib('gloo', timeout=30); break
        except RuntimeError:   # a failed join leaves no group behind
            if i == tries - 1: raise
    return waited, leave_after(0, delay, False)

def _part(fn, *args):
    try: return dict(ok=True, value=fn(*args))
    except Exception as e: return dict(ok=False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")

def one_group(search_path, resume_path):
    """Every check of a healthy 2-process group in one launch (each launch costs two imports of torch and fastai): the
    steps of `step_cases`, `search_and_resume`, `random_fit`, and leaving the group last (`leave_twice`). Each part's
    value or its error, so that a failing part fails its own tests and names itself"""
    return dict(steps=_part(step_cases), runs=_part(search_and_resume, search_path, resume_path), random=_part(random_fit),
                leave=_part(leave_twice))
