"""Helper for tests/test_reliability.py: a tiny, seeded DARTS search run that resumes from its latest checkpoint.

Usage: python tests/_resume_script.py RUN_DIR N_EPOCHS [SEED [DEVICE]]
Builds everything from SEED on DEVICE (default cpu), calls `search_learner(..., resume=True, path=RUN_DIR).fit(N_EPOCHS)` (on CUDA: not compiled) with a
`RunLogger('log.csv', append=True)`, and writes `RUN_DIR/epoch_NNNN.json` (losses of each epoch, atomically, as it
ends) and `RUN_DIR/result.json` at the end.
"""
import sys, json, hashlib
from pathlib import Path
import torch
from fastai.callback.core import Callback
from rnn_darts.genotypes import genotype_to_dict
from rnn_darts.folder import write_json_atomic
from rnn_darts.callbacks.logs import RunLogger
from tests._learners import tiny_learner

torch.set_num_threads(1)  # the same reduction order in every process

#: the numbers corpus's (train, valid, test) tokens: 10 training batches an epoch at bs 8, bptt 10 (a search epoch ~1 s at
#: one thread), 4 validation batches; enough for a kill to land inside a run and for the divergence tests' batch indices (< 9)
RUN = dict(n_train=800, n_valid=300, n_test=100, eval_bs=8, nhid=16, keep=2, checkpoint=True, quiet=False)

def build(path, seed=0, device='cpu', **kw):
    "The tiny search learner every resume test uses, built from `seed` on `device` (λ_max, which doubles an epoch's time: tests/test_curvature.py)"
    return tiny_learner(path=path, seed=seed, device=device, **{**RUN, 'mode': 'first', **kw})

def weights_hash(model):
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()): h.update(k.encode()); h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

class EpochLog(Callback):
    "Write the epoch's recorder row to RUN/epoch_NNNN.json once the epoch has ended"
    order = 85  # before Checkpoint (90): a kill in between only makes the resumed run redo (and rewrite) this epoch
    def after_epoch(self):
        if self.training is False and getattr(self.learn, 'final_record', None) is not None:
            write_json_atomic([float(v) for v in self.learn.final_record], Path(self.path)/f'epoch_{self.epoch:04d}.json')

if __name__ == '__main__':
    run, n = Path(sys.argv[1]), int(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    device = sys.argv[4] if len(sys.argv) > 4 else 'cpu'
    # on CUDA a compiled step differs from process to process (Inductor's atomic adds and timed kernel choices; measured on
    # an H200, 2026-11-27), so two uninterrupted runs differ too: the CUDA twin resumes eager steps, graphed as by default
    learn = build(run, seed, device, resume=True, cbs=[EpochLog(), RunLogger('log.csv', append=True)],
                  compile=None if device == 'cpu' else False)
    with learn.no_bar(), learn.no_logging(): learn.fit(n)
    write_json_atomic(dict(values=[[float(v) for v in r] for r in learn.recorder.values], first_epoch=learn.first_epoch,
                           genotype=genotype_to_dict(learn.model.genotype()), weights=weights_hash(learn.model),
                           alpha=learn.model.alpha.detach().tolist()), run/'result.json')
